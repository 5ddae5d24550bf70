"""End-to-end ablation of RollPacker on the built-in example, with paired accuracy parity and the TRL peer.

    python -m bench.e2e.ablation [--config configs/tiny-cpu.yaml] [--steps 10] [--seeds 0,1,2,3,4,5] [--p0 16]
                        [--r0 4] [--out runs/e2e] [--no-trl] [--results bench/results/e2e.json] [--eval-prompts N]

Runs the real program (``torchrun --nproc_per_node 2 -m rollpacker.train --config
configs/tiny-cpu.yaml``) in five cumulative modes (baseline, tail batching,
+ async reward, + parallelism planner with the config's measured TP profile,
+ stream trainer), same seed, same data
order, same number of trained prompts, each into ``OUT/<mode>-s<seed>/``; the
baseline and RollPacker (every component) also for the other seeds. Each run
is split into one-cycle chunks (the program resumes exactly from the previous
chunk's checkpoint) and the chunks of all runs are interleaved, in alternating
order, so every mode sees the same load on shared cores. The first step of
each chunk (engine and reward-pool start) is left out of the timings.

Written to ``--results`` (tracked; the block in docs/results.md is rendered from it by
``python -m bench.tools.report``) and printed: the ablation, the speedup per seed,
accuracy parity as RollPacker minus the baseline at the same seed (mean and
95% t-interval) on the training reward (plot: ``docs/e2e_reward.png``) and on
the final policies' held-out pass@1 (``--eval-n``), and the TRL GRPOTrainer
peer (``bench/e2e/trl_grpo.py``). ``--report-only`` re-reads existing runs. The
cluster-scale projection is ``python -m bench.system.sim``'s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.e2e import stats as rep
from bench.tools.results import write_results

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny-cpu.yaml"
CYCLE_STEPS = 5  # eta 1.25 in tiny-cpu.yaml: 4 short + 1 long round per cycle


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.e2e.ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG,
                   help="the program's config (configs/tiny-cpu-recheck.yaml: the task's reasoning-shaped variant)")
    p.add_argument("--steps", type=int, default=10, help="steps per run; whole cycles of 5 (default 2 cycles)")
    p.add_argument("--seeds", default="0,1,2,3,4,5",
                   help="comma-separated; baseline runs every seed, the ablation the first")
    p.add_argument("--rollpacker-seeds", help="seeds for RollPacker (all components); default: --seeds")
    p.add_argument("--p0", type=int, default=16)
    p.add_argument("--r0", type=int, default=4)
    p.add_argument("--out", default="runs/e2e")
    p.add_argument("--trl-python", default=sys.executable, help="python with trl installed for bench/e2e/trl_grpo.py")
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--results", default="bench/results/e2e.json", help="raw results (tracked)")
    p.add_argument("--report-only", action="store_true", help="re-read the runs in --out, run nothing")
    p.add_argument("--chunk-timeout", type=float, default=3600.0, help="seconds per torchrun chunk")
    p.add_argument("--eval-n", type=int, default=4,
                   help="held-out responses per eval prompt for the final policies' pass@1 (0: skip)")
    p.add_argument("--eval-prompts", type=int, help="held-out prompts scored per final policy (default: all)")
    p.add_argument("--plot", default="docs/e2e_reward.png")
    args = p.parse_args(argv)
    args.seed_list = [int(s) for s in args.seeds.split(",")]
    args.rp_seeds = [int(s) for s in (args.rollpacker_seeds or args.seeds).split(",")]
    if args.steps % CYCLE_STEPS:
        print(f"warning: --steps {args.steps} is not a whole number of {CYCLE_STEPS}-step cycles", file=sys.stderr)
    return args


def planned_runs(args: argparse.Namespace) -> list[tuple[str, rep.Mode, int]]:
    """(run name, mode, seed): every mode at the first seed, then the extra parity seeds."""
    first, runs = args.seed_list[0], []
    for seed in dict.fromkeys(args.seed_list + args.rp_seeds):
        for mode in rep.MODES:
            wanted = (seed == first or (mode.key == rep.BASELINE and seed in args.seed_list)
                      or (mode.key == rep.ROLLPACKER and seed in args.rp_seeds))
            if wanted:
                runs.append((f"{mode.key}-s{seed}", mode, seed))
    return runs


def program_args(args: argparse.Namespace, name: str, mode: rep.Mode, seed: int, steps: int) -> list[str]:
    common = [f"run.name={name}", f"run.output_dir={Path(args.out).resolve()}", f"run.steps={steps}",
              "run.save_every=0", "run.wandb=disabled", f"scheduler.p0={args.p0}", f"scheduler.r0={args.r0}",
              "run.eval.every=0", "run.eval.before_train=false"]  # the training's time alone
    return ["-m", "rollpacker.train", "--config", args.config, *common, *mode.args(), *rep.seed_overrides(seed)]


def run_chunk(args: argparse.Namespace, name: str, mode: rep.Mode, seed: int, steps: int) -> float:
    """One torchrun process up to ``steps`` (resuming the run's latest checkpoint); returns wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *program_args(args, name, mode, seed, steps)]
    log = Path(args.out) / f"{name}.log"
    start = time.monotonic()
    with log.open("a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                            timeout=args.chunk_timeout).returncode
    if rc:
        raise SystemExit(f"{name}: torchrun exited {rc}; last lines of {log}:\n" + log.read_text()[-4000:])
    return time.monotonic() - start


def clear_run(out: Path, name: str) -> None:
    """Remove an earlier run of ``name`` and its log: the program would otherwise resume it."""
    shutil.rmtree(out / name, ignore_errors=True)
    (out / f"{name}.log").unlink(missing_ok=True)


def run_all(args: argparse.Namespace, runs: list[tuple[str, rep.Mode, int]]) -> dict[str, Any]:
    """Every run in one-cycle chunks, the runs' chunks interleaved (order reversed every pass)."""
    out = Path(args.out)
    ends = list(range(CYCLE_STEPS, args.steps + 1, CYCLE_STEPS))
    if not ends or ends[-1] != args.steps:
        ends.append(args.steps)
    manifest: dict[str, Any] = {}
    for name, mode, seed in runs:
        clear_run(out, name)
        manifest[name] = {"mode": mode.key, "seed": seed, "warm_steps": [], "chunk_wall_s": []}
    prev = 0
    for k, end in enumerate(ends):
        for name, mode, seed in runs if k % 2 == 0 else runs[::-1]:
            wall = run_chunk(args, name, mode, seed, end)
            manifest[name]["warm_steps"].append(prev + 1)
            manifest[name]["chunk_wall_s"].append(wall)
            print(f"  {name:<20} steps {prev + 1:>3}-{end:<3} {wall:7.1f} s wall", flush=True)
        prev = end
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def load_metrics(path: Path) -> list[rep.Record]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trl_command(args: argparse.Namespace, out_json: Path) -> list[str]:
    """The TRL peer on our settings: same policy, prompts (data order seed), P0, R0, lr, length, cores."""
    from rollpacker.config import load_config

    cfg = load_config(REPO / args.config)
    script = REPO / "bench" / "e2e" / "trl_grpo.py"
    cmd = [args.trl_python, str(script), "--policy", cfg.model.path, "--data", cfg.data.train_files[0],
           "--steps", str(args.steps), "--p0", str(args.p0), "--r0", str(args.r0),
           "--max-response-length", str(cfg.rollout.max_response_length), "--lr", str(cfg.trainer.lr),
           "--seed", str(args.seed_list[0]), "--threads", str(2 * cfg.run.threads_per_rank),  # = 2 ranks' cores
           "--temperature", str(cfg.rollout.temperature), "--json", str(out_json)]
    if script.exists() and "--data-seed" in script.read_text():  # same prompt order as our data.seed
        cmd += ["--data-seed", str(args.seed_list[0])]
    return cmd


def trl_skip(args: argparse.Namespace) -> str | None:
    script = REPO / "bench" / "e2e" / "trl_grpo.py"
    import_error = None
    if not args.no_trl and script.exists():
        probe = subprocess.run([args.trl_python, "-c", "import trl"], capture_output=True, text=True)
        if probe.returncode:
            import_error = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
    return rep.trl_skip_reason(args.no_trl, script.exists(), import_error)


def run_trl(args: argparse.Namespace, tag: str) -> str | None:
    """One TRL run into OUT/trl_<tag>.json; returns why it failed, or None."""
    out_json = Path(args.out).resolve() / f"trl_{tag}.json"
    out_json.unlink(missing_ok=True)
    log = Path(args.out) / f"trl_{tag}.log"
    start = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(trl_command(args, out_json), cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"  TRL ({tag})            {time.monotonic() - start:7.1f} s wall", flush=True)
    return f"bench/e2e/trl_grpo.py exited {rc} (see {log})" if rc else None


def held_out_runs(config: str, out: Path, names: list[str], eval_n: int,
                  eval_prompts: int | None = None) -> dict[str, dict[str, float]]:
    """pass@1 and median response length on the held-out prompts of each run's final policy (its
    checkpoint's HF export; ``"start"``: the starting policy), cached in ``out/eval.json``. Unlike
    the training reward, it does not depend on which responses a round kept (short rounds keep the
    first to finish). Same sampling seed for every policy."""
    from rollpacker.config import load_config
    from rollpacker.examples.policy_report import evaluate_policy

    cache = out / "eval.json"
    done = json.loads(cache.read_text()) if cache.exists() else {}
    cfg = load_config(REPO / config).resolve(REPO)
    tag = f":n{eval_n}" + (f":p{eval_prompts}" if eval_prompts else "")
    for name in names:
        key = name + tag
        if key not in done:
            policy = cfg.model.path if name == "start" else str(sorted(
                (out / name / "checkpoints").glob("step_*"))[-1] / "hf")
            report, _ = evaluate_policy(policy, cfg.data.eval_files[0], n=eval_n, seed=0,
                                        threads=2 * cfg.run.threads_per_rank,
                                        max_new_tokens=cfg.rollout.max_response_length,
                                        max_prompt_length=cfg.data.max_prompt_length, max_prompts=eval_prompts)
            done[key] = {"pass_at_1": report.pass_at_1, "median_length": report.median_length}
            cache.write_text(json.dumps(done, indent=1))
    return {name: done[name + tag] for name in names}


def plot(runs: dict[str, dict[str, Any]], trl: dict[str, Any] | None, cycle_prompts: int, path: Path,
         config: str) -> None:
    """Reward and accuracy, each a mean over the trailing cycle of trained prompts (per-step values
    swing with the round kind: short rounds train the easy prompts, long rounds the hard ones)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {m.key: m.label for m in rep.MODES}
    style = {rep.BASELINE: ("0.3", "-", 1.5), rep.ROLLPACKER: ("tab:red", "-", 2.0),
             "tail_batching": ("tab:orange", "--", 1), "async_reward": ("tab:green", "--", 1),
             "planner": ("tab:purple", "--", 1)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True, sharey=True)
    for ax, key in zip(axes, ("reward_mean", "accuracy")):
        base = [r for r in runs.values() if r["mode"] == rep.BASELINE]
        if len(base) > 1:  # the baseline's seed-to-seed min-max
            curves = [rep.trailing_means(r["prompts"], r[key], cycle_prompts) for r in base]
            ax.fill_between(base[0]["prompts"], [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)],
                            color="0.6", alpha=0.3, label=f"baseline, min–max over {len(base)} seeds")
        seen: set[str] = set()
        for r in runs.values():
            colour, ls, lw = style.get(r["mode"], ("0.5", ":", 1))
            seeds = sorted(x["seed"] for x in runs.values() if x["mode"] == r["mode"])
            name = "RollPacker, all components" if r["mode"] == rep.ROLLPACKER else labels[r["mode"]]
            label = None if r["mode"] in seen else f"{name} (seed {', '.join(map(str, seeds))})"
            seen.add(r["mode"])
            ax.plot(r["prompts"], rep.trailing_means(r["prompts"], r[key], cycle_prompts), color=colour, ls=ls,
                    lw=lw, label=label)
        if trl:
            cum = rep.cumulative_prompts([{"prompts_kept": n} for n in _per_step(trl["prompts_trained"])])
            ax.plot(cum, rep.trailing_means(cum, trl[key], cycle_prompts), color="tab:blue", lw=1.5, ls=":",
                    label="TRL GRPOTrainer (seed 0)")
        ax.set_xlabel("trained prompts")
        ax.set_title(f"{key.replace('_', ' ')}, mean over the trailing {cycle_prompts} trained prompts", fontsize=10)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"Built-in example ({Path(config).name}) on 2 CPU ranks: GRPO reward vs trained prompts")
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _per_step(pt: list[int]) -> list[int]:
    cum = len(pt) > 1 and all(b > a for a, b in zip(pt, pt[1:]))
    return [b - a for a, b in zip([0] + pt, pt)] if cum else list(pt)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = planned_runs(args)
    from rollpacker.config import load_config
    for _, mode, seed in runs:  # an unknown key fails here, not an hour into the runs
        load_config(REPO / args.config, program_args(args, "check", mode, seed, args.steps)[4:])
    skip = trl_skip(args)
    if args.report_only:
        manifest = json.loads((out / "manifest.json").read_text())
    else:
        print(f"{len(runs)} runs of {args.steps} steps, P0={args.p0}, R0={args.r0}, in "
              f"{math.ceil(args.steps / CYCLE_STEPS)} interleaved pass(es), into {out}/", flush=True)
        # TRL is one process that cannot be chunked: run it before and after ours so that its
        # mean seconds bracket the load our runs saw.
        skip = skip or run_trl(args, "before")
        manifest = run_all(args, runs)
        skip = skip or run_trl(args, "after")
    trl_files = [out / f"trl_{tag}.json" for tag in ("before", "after")]
    trl_runs = [json.loads(f.read_text()) for f in trl_files if f.exists()] if skip is None else []
    if skip is None and not trl_runs:
        skip = f"no TRL results in {out}"
    cycle_prompts = CYCLE_STEPS * args.p0
    data: dict[str, dict[str, Any]] = {}
    for name, mode, seed in runs:
        recs = load_metrics(out / name / "metrics.jsonl")
        summary = rep.mode_summary(recs, set(manifest[name]["warm_steps"]))
        data[name] = {"mode": mode.key, "seed": seed, "summary": summary, "prompts": rep.cumulative_prompts(recs),
                      "reward_mean": [r["reward_mean"] for r in recs], "accuracy": [r["accuracy"] for r in recs],
                      "reward_last_cycle": rep.last_cycle_mean(recs, "reward_mean", cycle_prompts),
                      "accuracy_last_cycle": rep.last_cycle_mean(recs, "accuracy", cycle_prompts),
                      "steps": [{k: r.get(k) for k in ("step", "round", "rollout_tp", "prompts_kept", "reward_mean",
                                                       "accuracy", "rollout_s", "reward_s", "bubble_fraction",
                                                       "generated_tokens", "wasted_tokens", "time/step_s",
                                                       "time/rollout_s", "time/train_s", "time/sync_s",
                                                       "time/checkpoint_s")} for r in recs]}
    # Held-out pass@1 of every run's final policy (cached in OUT/eval.json).
    evals = (held_out_runs(args.config, Path(args.out), ["start", *data], args.eval_n, args.eval_prompts)
             if args.eval_n else {})
    held_out = {name: e["pass_at_1"] for name, e in evals.items()}
    s0 = args.seed_list[0]
    base = data[f"{rep.BASELINE}-s{s0}"]
    rows = []
    for mode in rep.MODES:
        d = data[f"{mode.key}-s{s0}"]
        note = ("no effect here: 0 groups trained before rollout ended"
                if mode.overrides["trainer.stream"] == "true" and not d["summary"]["stream_active"] else "")
        if mode.key == "planner":
            note = "chose rollout TP " + ", ".join(f"{k} {v}" for k, v in rep.planned_tps(d["steps"]).items())
        rows.append({"key": mode.key, "label": mode.label, "summary": d["summary"], "note": note,
                     "speedup": rep.speedup(base["summary"], d["summary"]), "reward_last_cycle": d["reward_last_cycle"],
                     "held_out": held_out.get(f"{mode.key}-s{s0}", math.nan)})
    per_seed = {s: rep.speedup(data[f"{rep.BASELINE}-s{s}"]["summary"], data[f"{rep.ROLLPACKER}-s{s}"]["summary"])
                for s in args.rp_seeds if s in args.seed_list}

    def paired(values: dict[str, float]) -> dict[str, Any]:
        return rep.paired_difference({s: values[f"{rep.BASELINE}-s{s}"] for s in args.seed_list},
                                     {s: values[f"{rep.ROLLPACKER}-s{s}"] for s in args.rp_seeds})

    window = (base["prompts"][-1] - cycle_prompts, base["prompts"][-1])
    mine = data[f"{rep.ROLLPACKER}-s{s0}"]
    plot(data, trl_runs[0] if trl_runs else None, cycle_prompts, REPO / args.plot, args.config)
    result = {"settings": {k: v for k, v in vars(args).items()}, "seed": s0,
              "trained_per_run": sorted({d["summary"]["prompts_trained"] for d in data.values()}),
              "ablation": rows, "per_seed_speedup": per_seed,
              "reward_parity": paired({name: d["reward_last_cycle"] for name, d in data.items()}),
              "held_out_pass": held_out, "held_out_parity": paired(held_out) if args.eval_n else None,
              "rollpacker_window": dict(mine["summary"], reward_window=mine["reward_last_cycle"],
                                        accuracy_window=mine["accuracy_last_cycle"]),
              "trl": rep.trl_summary(trl_runs, window) if trl_runs else None, "trl_raw": trl_runs,
              "trl_skip": skip, "trl_command": trl_command(args, Path(args.out) / "trl_before.json"),
              "runs": data, "manifest": manifest}
    path = write_results(args.results, result)
    print("\n" + rep.readme_markdown(json.loads(path.read_text())))
    print(f"\nplot: {args.plot}\nraw results: {path} (docs/results.md: python -m bench.tools.report)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
