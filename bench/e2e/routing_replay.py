"""Routing replay on CPU: the engine-trainer gap of a mixture-of-experts policy with and without it.

    python -m bench.e2e.routing_replay [--seeds 1,2,3,4] [--steps 5] [--out /tmp/routing_replay] \
        [--results bench/results/routing_replay.json]

A random tiny Qwen3-MoE (testkit's: 8 experts, top-2, a dense middle layer; the shipped tokenizer)
trained by the program on 2 CPU ranks with the reference engine in bf16 against the fp32 trainer,
so that near-ties in the router can pick other experts in the engine than in the trainer. Each seed
runs both arms (``trainer.routing_replay`` false / true, the engine reporting its routing in both),
whose first step trains the same responses (same weights, same seeds): step 1 is the exact paired
comparison; later steps start from weights that differ by what replay changed. Reported per arm and
step: ``mismatch/kl_k3``, ``mismatch/kl_k1``, ``train/logprob_mismatch_max``; and step 1's
difference (replay minus none) with its 95% t-interval over seeds.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench.e2e.stats import paired_difference
from bench.tools.results import REPO, write_results

ARMS = {"none": ["trainer.routing_replay=false"], "replay": ["trainer.routing_replay=true"]}
KEYS = ("mismatch/kl_k3", "mismatch/kl_k1", "train/logprob_mismatch_max", "mismatch/tokens")
COMMON = ["scheduler.p0=4", "scheduler.r0=4", "rollout.max_response_length=64", "run.wandb=disabled",
          "reward.num_workers=1", "run.eval.every=0", "run.eval.before_train=false", "run.save_every=0",
          "rollout.dtype=bf16", "rollout.return_routing=true", "scheduler.planner.enabled=false"]


def make_policy(out: Path, seed: int) -> Path:
    from testkit import make_random_qwen3_moe

    shipped = REPO / "assets" / "policy"
    vocab = json.loads((shipped / "config.json").read_text())["vocab_size"]
    policy = make_random_qwen3_moe(out / f"policy-s{seed}", seed=seed, vocab_size=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(shipped / name, policy / name)
    return policy


def run(policy: Path, arm: str, seed: int, steps: int, out: Path) -> list[dict]:
    name = f"{arm}-s{seed}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "rollpacker.train", "--config", "configs/tiny-cpu.yaml", f"run.output_dir={out}", f"run.name={name}",
           f"model.path={policy}", f"run.steps={steps}", f"run.seed={seed}", f"rollout.seed={seed}",
           f"data.seed={seed}", *COMMON, *ARMS[arm]]
    shutil.rmtree(out / name, ignore_errors=True)
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], **{k: r[k] for k in KEYS}} for r in rows if "round" in r]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3,4")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="/tmp/routing_replay")
    p.add_argument("--results", default="bench/results/routing_replay.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    runs = {arm: {} for arm in ARMS}
    for seed in seeds:
        policy = make_policy(out, seed)
        for arm in ARMS:
            runs[arm][seed] = run(policy, arm, seed, args.steps, out)
            first = runs[arm][seed][0]
            print(f"seed {seed} {arm}: step 1 kl_k3 {first['mismatch/kl_k3']:.3g}, "
                  f"max |dlogp| {first['train/logprob_mismatch_max']:.3g}", flush=True)
    step1 = {key: paired_difference({s: r[0][key] for s, r in runs["none"].items()},
                                    {s: r[0][key] for s, r in runs["replay"].items()}) for key in KEYS[:3]}
    means = {arm: {key: statistics.fmean(row[key] for rows in by_seed.values() for row in rows) for key in KEYS[:3]}
             for arm, by_seed in runs.items()}
    write_results(args.results, {
        "what": "a random tiny Qwen3-MoE, bf16 reference engine against the fp32 trainer: the engine-trainer gap "
                "without and with routing replay (step 1 paired: the same responses)",
        "arms": ARMS, "common": COMMON, "steps": args.steps, "seeds": seeds, "step1_replay_minus_none": step1,
        "mean_over_steps_and_seeds": means, "runs": runs})
    for key, d in step1.items():
        print(f"step 1 {key}: none {statistics.fmean(r[0][key] for r in runs['none'].values()):.3g}, replay "
              f"{statistics.fmean(r[0][key] for r in runs['replay'].values()):.3g}; replay - none {d['mean']:+.3g} "
              f"[{d['low']:+.3g}, {d['high']:+.3g}]")
    print(f"written to {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
