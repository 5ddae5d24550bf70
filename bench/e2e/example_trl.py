"""The independent check of the built-in example's recipe: TRL's GRPOTrainer on the same settings,
scored by the program's own held-out eval.

    python -m bench.e2e.example_trl --trl-python /path/to/venv/bin/python [--seeds 1,2,3,4] \
        [--config configs/tiny-cpu.yaml] [--rollpacker bench/results/example.json] \
        [--rollpacker-runs /tmp/example_recipe] [--out /tmp/example_trl] \
        [--results bench/results/example_trl.json] [--reuse]

``--trl-python`` is a Python with TRL (``pip install -r requirements-bench.txt``; a venv made with
``--system-site-packages`` keeps this repository's packages). From ``--config`` it takes the recipe:
P0 prompts x R0 responses per step, ``run.steps``, ``trainer.lr`` and ``lr_warmup_steps``,
``rollout.max_response_length`` and ``temperature``, the policy and the training file. Per seed S
it trains with ``bench/e2e/trl_grpo.py --seed S --data-seed S`` (the prompt order of ``data.seed=S``,
which the baseline trains in full) and saves the policy; then the program evaluates it the way it
evaluates every run, before its first step: ``torchrun --nproc_per_node 2 -m rollpacker.train
--config CONFIG model.path=<saved> run.steps=1 run.eval.every=0``, its step-0 eval line read from
``metrics.jsonl``. The starting policy is evaluated the same way in the same run.

So every number here comes from one eval code path, with step 0's eval seeds. A RollPacker run's
own last eval draws its samples with the seeds of its step; ``--rollpacker-runs`` (the ``--out`` of
``bench.e2e.example_recipe``) puts each run's last checkpoint through the same step-0 eval instead, so
that TRL minus RollPacker at a seed compares the policies alone. ``--reuse`` keeps the trained
policies and evals an earlier run of the command left in ``--out`` (the evals are seeded).

Writes ``--results``: commands, commit, the start and per-seed end values, TRL's change from the
start with its 95% t-interval over seeds, and TRL's end minus each RollPacker mode's last eval at
the same seed (from ``--rollpacker``, written by ``bench.e2e.example_recipe``, and with
``--rollpacker-runs`` under the same eval), paired by seed.
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
from bench.e2e.example_recipe import METRICS, curve
from rollpacker.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], log: Path) -> float:
    print("+", shlex.join(cmd), flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"exit {rc}: {shlex.join(cmd)} (see {log})")
    return time.perf_counter() - start


def held_out(config: str, policy: Path, out: Path, name: str, reuse: bool = False) -> dict:
    """The program's step-0 eval of ``policy``: greedy and temperature-1 pass@1."""
    cmd = ["torchrun", "--nproc_per_node", "2", "-m", "rollpacker.train", "--config", config,
           f"model.path={policy}", f"run.name={name}", f"run.output_dir={out}", "run.steps=1",
           "run.eval.every=0", "run.eval.before_train=true", "run.save_every=0", "run.wandb=disabled"]
    metrics = out / name / "metrics.jsonl"
    if reuse and metrics.is_file():  # the eval is seeded: a rerun would read the same numbers
        wall = None
    else:
        shutil.rmtree(out / name, ignore_errors=True)  # a same-named run would resume instead
        wall = round(_run(cmd, out / f"{name}.log"), 1)
    first = curve(metrics)[0]
    assert first["step"] == 0, first
    return {"command": shlex.join(cmd), "wall_s": wall, **{k: first[f"{k}_pass@1"] for k in METRICS}}


def train_trl(args, cfg, seed: int, out: Path) -> dict:
    saved, result = out / f"trl-s{seed}", out / f"trl-s{seed}.json"
    cmd = [args.trl_python, "bench/e2e/trl_grpo.py", "--policy", cfg.model.path, "--data", cfg.data.train_files[0],
           "--steps", str(cfg.run.steps), "--p0", str(cfg.scheduler.p0), "--r0", str(cfg.scheduler.r0),
           "--max-response-length", str(cfg.rollout.max_response_length),
           "--max-prompt-length", str(cfg.data.max_prompt_length), "--lr", repr(cfg.trainer.lr),
           "--lr-warmup-steps", str(cfg.trainer.lr_warmup_steps), "--temperature", repr(cfg.rollout.temperature),
           "--seed", str(seed), "--data-seed", str(seed), "--threads", "2",
           "--json", str(result), "--save", str(saved)]
    if args.reuse and result.is_file() and (saved / "config.json").is_file():
        wall = None
    else:
        shutil.rmtree(saved, ignore_errors=True)
        wall = round(_run(cmd, out / f"trl-s{seed}.log"), 1)
    trl = json.loads(result.read_text())
    return {"seed": seed, "command": shlex.join(cmd), "wall_s": wall,
            "train_seconds": round(sum(trl["seconds_per_step"]), 1), "train_reward": trl["reward_mean"], "lr": trl["lr"], "trl_version": trl["trl_version"],
            "eval": held_out(args.config, saved, out, f"eval-trl-s{seed}", args.reuse)}


def rollpacker_same_eval(args, rollpacker: dict, out: Path, seeds: list[int]) -> dict[str, dict[int, dict]]:
    """Each RollPacker run of ``seeds``: its last checkpoint (the HF export, in ``--rollpacker-runs``)
    through the same step-0 eval as TRL's policies, the same eval seeds on both sides."""
    found: dict[str, dict[int, dict]] = {}
    for r in (r for r in rollpacker["runs"] if r["seed"] in seeds):
        name = f"{r['mode']}-s{r['seed']}"
        hf = Path(args.rollpacker_runs) / name / "checkpoints" / f"step_{r['step_last']:08d}" / "hf"
        if not (hf / "config.json").is_file():
            raise SystemExit(f"{hf}: no HF export of {name}'s last step (run bench.e2e.example_recipe with --out there)")
        found.setdefault(r["mode"], {})[r["seed"]] = held_out(args.config, hf, out, f"eval-{name}", args.reuse)
    return found


def compare(start: dict, runs: list[dict], rollpacker: dict | None, same_eval: dict[str, dict[int, dict]]) -> dict:
    end = {k: {r["seed"]: r["eval"][k] for r in runs} for k in METRICS}
    out = {"change": {k: paired_difference({s: start[k] for s in end[k]}, end[k]) for k in METRICS},
           "trl_minus_rollpacker_last_eval": {}, "trl_minus_rollpacker_same_eval": {}}
    for mode in sorted({r["mode"] for r in (rollpacker or {}).get("runs", [])}):
        ours = {r["seed"]: r for r in rollpacker["runs"] if r["mode"] == mode}
        out["trl_minus_rollpacker_last_eval"][mode] = {
            k: paired_difference({s: r[f"{k}_end"] for s, r in ours.items()}, end[k]) for k in METRICS}
    for mode, ours in same_eval.items():
        out["trl_minus_rollpacker_same_eval"][mode] = {
            k: paired_difference({s: e[k] for s, e in ours.items()}, end[k]) for k in METRICS}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trl-python", required=True, help="a python with trl installed")
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--seeds", default="1,2,3,4")
    p.add_argument("--rollpacker", default="bench/results/example.json",
                   help="bench.e2e.example_recipe's results, for TRL minus RollPacker at the same seed")
    p.add_argument("--rollpacker-runs", default=None,
                   help="bench.e2e.example_recipe's --out: its runs' last checkpoints get the same eval as TRL's")
    p.add_argument("--out", default="/tmp/example_trl")
    p.add_argument("--results", default="bench/results/example_trl.json")
    p.add_argument("--reuse", action="store_true",
                   help="keep what an earlier run of this command left in --out (trained policies, evals)")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    start = held_out(args.config, Path(cfg.model.path), out, "eval-start", args.reuse)
    print(f"start: greedy {start['greedy']:.3f}, t1 {start['t1']:.3f}", flush=True)
    runs, seeds = [], [int(s) for s in args.seeds.split(",") if s]
    for seed in seeds:
        runs.append(train_trl(args, cfg, seed, out))
        e = runs[-1]["eval"]
        wall = runs[-1]["wall_s"]
        print(f"TRL seed {seed}: greedy {start['greedy']:.3f} -> {e['greedy']:.3f}, "
              f"t1 {start['t1']:.3f} -> {e['t1']:.3f} ({e['t1'] - start['t1']:+.3f}), "
              + ("trained earlier (--reuse)" if wall is None else f"{wall:.0f} s training"), flush=True)
    rollpacker = json.loads(Path(args.rollpacker).read_text()) if Path(args.rollpacker).is_file() else None
    same_eval = rollpacker_same_eval(args, rollpacker, out, seeds) if rollpacker and args.rollpacker_runs else {}
    summary = compare(start, runs, rollpacker, same_eval)
    result = {
        "what": "held-out pass@1 after TRL GRPOTrainer with the built-in example's recipe, scored by the "
                "program's step-0 eval; the starting policy scored the same way",
        "command": shlex.join([sys.executable, "-m", "bench.e2e.example_trl",
                               *(argv if argv is not None else sys.argv[1:])]),
        "config": args.config, "commit": commit, "rollpacker_results": args.rollpacker,
        "rollpacker_commit": (rollpacker or {}).get("commit"), "cores": os.cpu_count(),
        "start": start, **summary, "runs": runs, "rollpacker_same_eval": same_eval,
    }
    Path(args.results).write_text(json.dumps(result, indent=1) + "\n")
    for key, c in summary["change"].items():
        print(f"TRL: {key} pass@1 change {c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}] over {c['n']} seeds")
    for what in ("last_eval", "same_eval"):
        for mode, by_key in summary[f"trl_minus_rollpacker_{what}"].items():
            for key, c in by_key.items():
                print(f"TRL - RollPacker {mode} ({what.replace('_', ' ')}), {key}: "
                      f"{c['mean']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]")
    print(f"written to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
