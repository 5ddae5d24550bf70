"""The built-in example's GRPO recipe, measured held-out over several seeds.

    python -m bench.example_recipe [--seeds 1,2] [--out /tmp/example_recipe] \
        [--results bench/results/example.json] [--config configs/tiny-cpu.yaml] [-- extra overrides]

Runs ``torchrun --nproc_per_node 2 -m rollpacker.train --config CONFIG run.seed=S ...`` once per
seed (one at a time: each run takes both ranks), each into a fresh ``OUT/s<S>/`` directory,
and reads every eval line of its ``metrics.jsonl``: greedy pass@1 and pass@1 at temperature 1
(``eval/greedy/pass@1``, ``eval/t1/pass@1``) per evaluated step, step 0 being the starting policy.

Writes ``--results``: the command of each run, the commit, wall seconds per run, the per-seed
curves and, per seed, start -> end of both numbers and whether the run met the example's target
(t1 pass@1 up by >= 0.10 absolute and greedy pass@1 not down, within 300 s of wall time).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_T1_GAIN = 0.10
TARGET_WALL_S = 300.0


def curves(metrics: Path) -> list[dict]:
    out = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "eval/greedy/pass@1" in row:
            out.append({"step": row["step"], "greedy_pass@1": row["eval/greedy/pass@1"],
                        "t1_pass@1": row.get("eval/t1/pass@1"), "t1_pass@4": row.get("eval/t1/pass@4"),
                        "prompts": row.get("eval/greedy/prompts")})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--out", default="/tmp/example_recipe")
    p.add_argument("--results", default="bench/results/example.json")
    p.add_argument("--tag", default="", help="a prefix of the run directories")
    p.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every seed")
    args = p.parse_args(argv)
    out = Path(args.out)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", args.config, "rollpacker", "assets"],
                                cwd=REPO, capture_output=True, text=True).stdout.strip())
    runs = []
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        name = f"{args.tag}s{seed}"
        shutil.rmtree(out / name, ignore_errors=True)  # a same-named run would resume instead
        cmd = ["torchrun", "--nproc_per_node", "2", "-m", "rollpacker.train", "--config", args.config,
               f"run.name={name}", f"run.output_dir={out}", f"run.seed={seed}", "run.wandb=disabled",
               "run.save_every=0", *args.overrides]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        print("+", shlex.join(cmd), flush=True)
        start = time.perf_counter()
        log = (out / f"{name}.log")
        out.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
        wall = time.perf_counter() - start
        if rc:
            print(f"seed {seed}: exit {rc}, see {log}", file=sys.stderr)
            return rc
        curve = curves(out / name / "metrics.jsonl")
        first, last = curve[0], curve[-1]
        gain = last["t1_pass@1"] - first["t1_pass@1"]
        met = gain >= TARGET_T1_GAIN and last["greedy_pass@1"] >= first["greedy_pass@1"] and wall <= TARGET_WALL_S
        runs.append({"seed": seed, "command": shlex.join(cmd), "wall_s": round(wall, 1), "curve": curve,
                     "greedy_start": first["greedy_pass@1"], "greedy_end": last["greedy_pass@1"],
                     "t1_start": first["t1_pass@1"], "t1_end": last["t1_pass@1"], "t1_gain": round(gain, 4),
                     "met_target": met})
        print(f"seed {seed}: greedy {first['greedy_pass@1']:.3f} -> {last['greedy_pass@1']:.3f}, "
              f"t1 {first['t1_pass@1']:.3f} -> {last['t1_pass@1']:.3f} ({gain:+.3f}), {wall:.0f} s wall"
              f"{'  (met the target)' if met else ''}", flush=True)
    result = {
        "what": "held-out pass@1 of the built-in example's GRPO recipe, per seed (step 0: the starting policy)",
        "target": {"t1_pass@1_gain_min": TARGET_T1_GAIN, "greedy_pass@1": "not below step 0",
                   "wall_s_max": TARGET_WALL_S},
        "config": args.config, "overrides": args.overrides, "commit": commit,
        "tree_dirty_in_config_rollpacker_assets": dirty,
        "cores": os.cpu_count(), "load_average_at_end": list(os.getloadavg()),
        "runs": runs,
        "seeds_met_target": sum(r["met_target"] for r in runs),
    }
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['seeds_met_target']}/{len(runs)} seeds met the target; written to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
