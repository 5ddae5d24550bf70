"""The built-in example's GRPO recipe, measured held-out over seeds, tail batching against the baseline.

    python -m bench.e2e.example_recipe [--seeds 1,2,3,4] [--modes tail_batching,baseline] \
        [--out /tmp/example_recipe] [--results bench/results/example.json] \
        [--plot docs/example_curve.png] [--config configs/tiny-cpu.yaml] [-- extra overrides]

Runs ``torchrun --nproc_per_node 2 -m rollpacker.train --config CONFIG run.seed=S data.seed=S
rollout.seed=S scheduler.mode=M ...`` once per seed and mode, one at a time (each run takes both
ranks; ``run.seed`` alone seeds only the trainer's init, while the data order and the sampling
have seeds of their own), each into a fresh ``OUT/<M>-s<S>/`` directory, and reads every eval line of its ``metrics.jsonl``: greedy pass@1 and
pass@1 at temperature 1 (``eval/greedy/pass@1``, ``eval/t1/pass@1``) per evaluated step, step 0 being
the starting policy.

Writes ``--results``: the command of each run, the commit, wall seconds per run, the per-seed curves
and, per mode, the change of both numbers from step 0 to the last step with its 95% paired
t-interval over seeds; the two modes' last-step values compared the same way (paired by seed); and
whether the example's target is met: in every mode, t1 pass@1 up by >= 0.10 on average with an
interval above 0, greedy pass@1 not lowered (its interval reaches 0 or above), every run within
300 s of wall time, and the modes at parity on both numbers (intervals containing 0).
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

from bench.e2e.stats import paired_difference

REPO = Path(__file__).resolve().parents[2]
TARGET_T1_GAIN = 0.10
TARGET_WALL_S = 300.0
METRICS = {"t1": "eval/t1/pass@1", "greedy": "eval/greedy/pass@1"}


def curve(metrics: Path) -> list[dict]:
    out = []
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if METRICS["greedy"] in row:
            out.append({"step": row["step"], "greedy_pass@1": row[METRICS["greedy"]],
                        "t1_pass@1": row.get(METRICS["t1"]), "t1_pass@4": row.get("eval/t1/pass@4"),
                        "prompts": row.get("eval/greedy/prompts")})
    return out


def run_one(args, mode: str, seed: int, out: Path) -> dict:
    name = f"{args.tag}{mode}-s{seed}"
    shutil.rmtree(out / name, ignore_errors=True)  # a same-named run would resume instead
    cmd = ["torchrun", "--nproc_per_node", "2", "-m", "rollpacker.train", "--config", args.config,
           f"run.name={name}", f"run.output_dir={out}", f"run.seed={seed}", f"data.seed={seed}",
           f"rollout.seed={seed}", f"scheduler.mode={mode}",
           "run.wandb=disabled", "run.save_every=0", *args.overrides]
    print("+", shlex.join(cmd), flush=True)
    log = out / f"{name}.log"
    start = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc:
        raise SystemExit(f"{mode} seed {seed}: exit {rc}, see {log}")
    points = curve(out / name / "metrics.jsonl")
    first, last = points[0], points[-1]
    run = {"mode": mode, "seed": seed, "command": shlex.join(cmd), "wall_s": round(wall, 1), "curve": points,
           "step_last": last["step"], **{f"{k}_start": first[f"{k}_pass@1"] for k in METRICS},
           **{f"{k}_end": last[f"{k}_pass@1"] for k in METRICS}}
    print(f"{mode} seed {seed}: greedy {run['greedy_start']:.3f} -> {run['greedy_end']:.3f}, "
          f"t1 {run['t1_start']:.3f} -> {run['t1_end']:.3f} ({run['t1_end'] - run['t1_start']:+.3f}), "
          f"{wall:.0f} s wall", flush=True)
    return run


def summarize(runs: list[dict], modes: list[str]) -> dict:
    by = {m: {r["seed"]: r for r in runs if r["mode"] == m} for m in modes}
    per_mode = {}
    for mode, seeds in by.items():
        change = {k: paired_difference({s: r[f"{k}_start"] for s, r in seeds.items()},
                                       {s: r[f"{k}_end"] for s, r in seeds.items()}) for k in METRICS}
        t1, greedy = change["t1"], change["greedy"]
        max_wall = max(r["wall_s"] for r in seeds.values())
        per_mode[mode] = {
            "t1_change": t1, "greedy_change": greedy, "max_wall_s": max_wall,
            "met": (t1["mean"] >= TARGET_T1_GAIN and t1["low"] > 0 and greedy["high"] >= 0
                    and max_wall <= TARGET_WALL_S),
        }
    parity = {}
    if len(modes) == 2:
        base, other = by[modes[1]], by[modes[0]]
        parity = {k: paired_difference({s: r[f"{k}_end"] for s, r in base.items()},
                                       {s: r[f"{k}_end"] for s, r in other.items()}) for k in METRICS}
    met = all(m["met"] for m in per_mode.values()) and all(p["low"] <= 0 <= p["high"] for p in parity.values())
    return {"per_mode": per_mode, "parity_last_step": parity, "met_target": met}


def plot(runs: list[dict], modes: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    colors = dict(zip(modes, ("tab:blue", "tab:orange", "tab:green")))
    for ax, key, title in zip(axes, ("t1_pass@1", "greedy_pass@1"),
                              ("pass@1 at temperature 1 (4 samples)", "greedy pass@1")):
        for mode in modes:
            mine = [r for r in runs if r["mode"] == mode]
            for r in mine:
                ax.plot([p["step"] for p in r["curve"]], [p[key] for p in r["curve"]],
                        color=colors[mode], alpha=0.25, lw=1)
            steps = [p["step"] for p in mine[0]["curve"]]
            mean = [sum(r["curve"][i][key] for r in mine) / len(mine) for i in range(len(steps))]
            ax.plot(steps, mean, color=colors[mode], marker="o", lw=2, label=f"{mode} (mean of {len(mine)} seeds)")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out pass@1")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("configs/tiny-cpu.yaml, held-out prompts (bench/results/example.json)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--seeds", default="1,2,3,4")
    p.add_argument("--modes", default="tail_batching,baseline",
                   help="scheduler modes; with two, the first is compared against the second")
    p.add_argument("--out", default="/tmp/example_recipe")
    p.add_argument("--results", default="bench/results/example.json")
    p.add_argument("--plot", default=None, help="also draw the curves to this image")
    p.add_argument("--tag", default="", help="a prefix of the run directories")
    p.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", args.config, "rollpacker", "assets"],
                                cwd=REPO, capture_output=True, text=True).stdout.strip())
    runs = [run_one(args, mode, seed, out) for seed in seeds for mode in modes]
    summary = summarize(runs, modes)
    result = {
        "what": "held-out pass@1 of the built-in example's GRPO recipe, per seed and scheduler mode "
                "(step 0: the starting policy)",
        "target": {"t1_pass@1_gain_min": TARGET_T1_GAIN, "greedy_pass@1": "not lowered (interval reaches 0)",
                   "wall_s_max": TARGET_WALL_S, "modes": "parity at the last step (intervals contain 0)"},
        "command": shlex.join([sys.executable, "-m", "bench.e2e.example_recipe", *(argv if argv is not None else sys.argv[1:])]),
        "config": args.config, "overrides": args.overrides, "commit": commit,
        "tree_dirty_in_config_rollpacker_assets": dirty,
        "cores": os.cpu_count(), "load_average_at_end": list(os.getloadavg()),
        **summary, "runs": runs,
    }
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(result, indent=1) + "\n")
    for mode, m in summary["per_mode"].items():
        for key in METRICS:
            c = m[f"{key}_change"]
            print(f"{mode}: {key} pass@1 change {c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] "
                  f"over {c['n']} seeds; slowest run {m['max_wall_s']:.0f} s")
    for key, c in summary["parity_last_step"].items():
        print(f"{modes[0]} - {modes[1]} at the last step, {key}: {c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]")
    print(f"target {'met' if summary['met_target'] else 'NOT met'}; written to {args.results}")
    if args.plot:
        plot(runs, modes, Path(args.plot))
        print(f"curves drawn to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
