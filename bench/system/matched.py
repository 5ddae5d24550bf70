"""What ``rollout.match_trainer`` costs and what it removes: the program with the reference engine
(fp32, KV-cached) and with the trainer-matched engine, same seed, same settings, in one run.

    python -m bench.system.matched [--steps 5] [--seed 1] [--out /tmp/matched] \
        [--results bench/results/matched.json] [-- extra overrides]

Both arms run ``configs/tiny-cpu.yaml`` on 2 CPU ranks, scaled down so that the matched engine's
whole-window recompute stays affordable: 4 prompts x 4 responses, responses up to 128 tokens,
prompts up to 64 (a 192-token window), the planner off (the mode needs rollout TP 1). Prints and
writes per arm: rollout seconds per step, tokens generated, and the engine-trainer gap per step
(``mismatch/kl_k3``, ``train/logprob_mismatch_max``); and the matched / reference rollout-time ratio.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from bench.tools.results import write_results
from testkit import REPO_ROOT

SETTINGS = ["scheduler.p0=4", "scheduler.r0=4", "rollout.max_response_length=128", "data.max_prompt_length=64",
            "scheduler.planner.enabled=false", "reward.num_workers=1", "run.eval.every=0",
            "run.eval.before_train=false", "run.wandb=disabled", "run.save_every=0"]
ARMS = {"reference": ["rollout.dtype=fp32"], "matched": ["rollout.match_trainer=true"]}


def run_arm(arm: str, args: argparse.Namespace) -> dict:
    shutil.rmtree(args.out / arm, ignore_errors=True)
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "rollpacker.train",
           "--config", "configs/tiny-cpu.yaml", f"run.output_dir={args.out}", f"run.name={arm}",
           f"run.steps={args.steps}", *(f"{k}={args.seed}" for k in ("run.seed", "data.seed", "rollout.seed")),
           *SETTINGS, *ARMS[arm], *args.overrides]
    print("+", shlex.join(cmd), flush=True)
    start = time.perf_counter()
    with (args.out / f"{arm}.log").open("w") as log:
        subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (args.out / arm / "metrics.jsonl").read_text().splitlines()]
    steps = [{"step": r["step"], "round": r["round"], "rollout_s": r["time/rollout_s"],
              "response_tokens": r["mismatch/tokens"], "kl_k3": r["mismatch/kl_k3"],
              "logprob_mismatch_max": r["train/logprob_mismatch_max"], "reward_mean": r["reward_mean"]}
             for r in rows if "round" in r]
    out = {"command": shlex.join(cmd), "wall_s": round(wall, 1), "steps": steps,
           "rollout_s_mean": statistics.fmean(s["rollout_s"] for s in steps),
           "kl_k3_max": max(s["kl_k3"] for s in steps),
           "logprob_mismatch_max": max(s["logprob_mismatch_max"] for s in steps)}
    print(f"{arm}: rollout {out['rollout_s_mean']:.2f} s/step, kl_k3 max {out['kl_k3_max']:.3e}, "
          f"max |dlogp| {out['logprob_mismatch_max']:.3e}, {wall:.0f} s wall", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("/tmp/matched"))
    parser.add_argument("--results", default=str(REPO_ROOT / "bench/results/matched.json"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    arms = {arm: run_arm(arm, args) for arm in ARMS}
    ratio = arms["matched"]["rollout_s_mean"] / arms["reference"]["rollout_s_mean"]
    print(f"matched / reference rollout time: {ratio:.1f}x")
    write_results(args.results, {"settings": SETTINGS, "steps": args.steps, "seed": args.seed, "arms": arms,
                                 "rollout_time_ratio": ratio})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
