"""What the deterministic race costs: short rounds decided by response lengths (``scheduler.race:
deterministic``) against the wall-clock race (``first_finished``), in the same run.

    python -m bench.system.race [--rounds 10] [--steps 10] [--seed 1] [--seeds 1,2,3] [--skip-program] \
        [--out /tmp/race] [--results bench/results/race.json]

The deterministic race closes a round only once no running response could still beat the kept
groups' marks, so it generates more tokens while stragglers pass the mark. Measured two ways:

* the simulator at the published settings (Qwen2.5-7B/14B/32B, 8k/16k/32k, 16/32/64 H800, P0=128,
  R0=8, eta 1.25; the trace of ``bench.system.sim``), tail batching with each race on the same trace:
  mean short-round rollout seconds and generated tokens. The simulator checks the close at its events
  (completions), so the deterministic race's close can come a little late there: an upper bound.
* the program on this CPU (``configs/tiny-cpu.yaml`` on 2 ranks, the reference engines, validation
  off, ``--steps`` steps), once with each race per seed: mean short-round rollout seconds and
  generated tokens per short round, their ratios paired by seed. The two races keep different
  prompts, so steps are not paired, and one seed's ratio is noisy.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import statistics
import subprocess
from pathlib import Path

from bench.e2e.stats import paired_difference
from bench.system.sim import PUBLISHED, published_trace
from bench.tools.results import write_results
from rollpacker.sim.run import SimSettings, run_mode
from testkit import REPO_ROOT

RACES = ("first_finished", "deterministic")


def short_means(rows: list[dict]) -> dict:
    short = [r for r in rows if r["kind"] == "short"]
    return {"short_rounds": len(short),
            "short_rollout_s": statistics.fmean(r["rollout_s"] for r in short),
            "short_generated_tokens": statistics.fmean(r["generated_tokens"] for r in short)}


def ratios(by_race: dict) -> dict:
    a, b = by_race["first_finished"], by_race["deterministic"]
    return {"rollout_s_ratio": b["short_rollout_s"] / a["short_rollout_s"],
            "generated_tokens_ratio": b["short_generated_tokens"] / a["short_generated_tokens"]}


def simulate(rounds: int, seed: int) -> list[dict]:
    out = []
    for model, limit, gpus, tp, _, _ in PUBLISHED:
        settings = SimSettings(model=model, limit=limit, gpus=gpus, tp=tp, rounds=rounds, seed=seed)
        trace = published_trace(limit, seed)
        by_race = {}
        for race in RACES:
            rows = run_mode("tail_batching", dataclasses.replace(settings, race=race), trace)
            by_race[race] = short_means([{"kind": r.kind, "rollout_s": r.stats.rollout_seconds,
                                          "generated_tokens": r.stats.generated_tokens} for r in rows])
        row = {"model": model, "limit": limit, "gpus": gpus, "tp": tp, **by_race, **ratios(by_race)}
        print(f"sim {model} {limit // 1024}k {gpus} GPUs: short round {by_race['first_finished']['short_rollout_s']:.1f}"
              f" -> {by_race['deterministic']['short_rollout_s']:.1f} s ({row['rollout_s_ratio']:.3f}x), generated "
              f"tokens {row['generated_tokens_ratio']:.3f}x", flush=True)
        out.append(row)
    return out


def program_seed(steps: int, seed: int, out: Path) -> dict:
    by_race, commands = {}, {}
    for race in RACES:
        name = f"{race}-s{seed}"
        shutil.rmtree(out / name, ignore_errors=True)
        cmd = ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "rollpacker.train",
               "--config", "configs/tiny-cpu.yaml", f"run.output_dir={out}", f"run.name={name}", f"run.steps={steps}",
               *(f"{k}={seed}" for k in ("run.seed", "data.seed", "rollout.seed")), f"scheduler.race={race}",
               "run.eval.every=0", "run.eval.before_train=false", "run.wandb=disabled", "run.save_every=0"]
        print("+", shlex.join(cmd), flush=True)
        with (out / f"{name}.log").open("w") as log:
            subprocess.run(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
        rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        by_race[race] = short_means([{"kind": r["round"], "rollout_s": r["time/rollout_s"],
                                      "generated_tokens": r["generated_tokens"]} for r in rows if "round" in r])
        commands[race] = shlex.join(cmd)
    result = {"seed": seed, "commands": commands, **by_race, **ratios(by_race)}
    print(f"program on this CPU, seed {seed}: short round {by_race['first_finished']['short_rollout_s']:.2f} -> "
          f"{by_race['deterministic']['short_rollout_s']:.2f} s ({result['rollout_s_ratio']:.3f}x), generated tokens "
          f"{result['generated_tokens_ratio']:.3f}x", flush=True)
    return result


def program(steps: int, seeds: list[int], out: Path) -> dict:
    """Each seed once per race; the ratios' mean and 95% t-interval over seeds (runs of one seed are
    a pair: the same data order and sampling seeds, different kept prompts)."""
    runs = [program_seed(steps, seed, out) for seed in seeds]
    summary = {"steps": steps, "seeds": seeds, "runs": runs}
    for key in ("short_rollout_s", "short_generated_tokens"):
        base = {r["seed"]: r["first_finished"][key] for r in runs}
        diff = paired_difference(base, {r["seed"]: r["deterministic"][key] for r in runs})
        summary[f"{key}_difference"] = diff
        summary[f"{key}_ratio"] = statistics.fmean(r["deterministic"][key] for r in runs) / statistics.fmean(
            base.values())
        print(f"program {key}: deterministic - first_finished {diff['mean']:+.3f} "
              f"[{diff['low']:+.3f}, {diff['high']:+.3f}] over seeds {seeds}; ratio of means "
              f"{summary[f'{key}_ratio']:.3f}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="simulated rounds per race (10 = two cycles)")
    parser.add_argument("--steps", type=int, default=10, help="program steps per race")
    parser.add_argument("--seed", type=int, default=1, help="the simulated trace's")
    parser.add_argument("--seeds", default="1,2,3", help="the program's, one run per race each")
    parser.add_argument("--skip-program", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("/tmp/race"))
    parser.add_argument("--results", default=str(REPO_ROOT / "bench/results/race.json"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"seed": args.seed, "simulated": simulate(args.rounds, args.seed)}
    if not args.skip_program:
        payload["program"] = program(args.steps, [int(x) for x in args.seeds.split(",")], args.out)
    write_results(args.results, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
