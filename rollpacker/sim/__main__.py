"""``rollpacker-sim`` (or ``python -m rollpacker.sim``): baseline vs tail batching on a modeled H800 cluster.

    rollpacker-sim --trace lengths.jsonl            # Qwen2.5-14B, 32 GPUs, TP 2, 16k
    rollpacker-sim --model 32b --gpus 64 --limit 32768 --json
    rollpacker-sim --planner                        # per-round-kind TP, online rule
    rollpacker-sim --epochs 4 --rho 0.9 --history on  # every prompt once per epoch
    rollpacker-sim --end-to-end                     # the whole step, component by component

Without ``--trace`` the lengths come from the parametric long-tail model
(``rollpacker.sim.traces``). ``--json`` prints the same report as JSON.

``--epochs N`` runs each mode until every prompt has been trained once in
each of epochs 0..N-1 (served in a new seeded order every epoch) instead of
a fixed number of rounds, and reports per epoch (``rollpacker.sim.epochs``);
tail batching runs with or without ``--history``. Without ``--trace`` the
per-prompt medians move between epochs by ``--rho`` and ``--drift``
(``multi_epoch_trace``).

``--end-to-end`` models the whole training step (rollout, reward, training,
weight sync) for the published ablation, one component added per row
(``rollpacker.sim.step``, where each cost's assumption is stated); the
planner and the stream trainer are turned on by their rows.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from rollpacker.cli_help import HelpFormatter
from rollpacker.scheduler.config import HistoryConfig
from rollpacker.sim.epochs import compare, run_epochs
from rollpacker.sim.perf import Efficiency
from rollpacker.sim.run import SimSettings, row_dict, run_mode, summarize
from rollpacker.sim.step import ABLATION, StepCosts, run_ablation, step_dict, summarize_steps
from rollpacker.sim.traces import TraceError, epoch_spearman, load_trace, longtail_trace, multi_epoch_trace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d, e = SimSettings(), Efficiency()
    p = argparse.ArgumentParser(prog="rollpacker-sim", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--trace", help="JSONL length trace; default: the parametric long-tail model")
    p.add_argument("--model", default=d.model, choices=["7b", "14b", "32b"])
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--tp", type=int, default=d.tp, help="rollout TP (initial TP with --planner)")
    p.add_argument("--p0", type=int, default=d.p0)
    p.add_argument("--r0", type=int, default=d.r0)
    p.add_argument("--eta", type=float, help="sets both --eta-p and --eta-r")
    p.add_argument("--eta-p", type=float, default=d.eta_p)
    p.add_argument("--eta-r", type=float, default=d.eta_r)
    p.add_argument("--limit", type=int, default=d.limit, help="max response length (tokens)")
    p.add_argument("--rounds", type=int, help=f"rounds per mode (default {d.rounds}; not with --epochs)")
    p.add_argument("--planner", action="store_true", help="tail batching with the parallelism planner")
    p.add_argument("--max-tp", type=int, default=d.max_tp, help="GPUs per node")
    p.add_argument("--seed", type=int, default=d.seed)
    m = p.add_argument_group("epochs")
    m.add_argument("--epochs", type=int, help="train every prompt once per epoch for this many epochs")
    m.add_argument("--history", choices=["on", "off"], help="history-aware tail batching (default off)")
    m.add_argument("--rho", type=float, help="without --trace: epoch-to-epoch correlation of a prompt's "
                                             "log median length (default 1.0: the same every epoch)")
    m.add_argument("--drift", type=float, help="without --trace: growth of log median length per epoch "
                                               "(default 0.0)")
    g = p.add_argument_group("parametric long-tail model (without --trace)")
    g.add_argument("--num-prompts", type=int, default=2048)
    g.add_argument("--median", type=float, help="median response length; default limit/28")
    g.add_argument("--sigma-prompt", type=float, default=0.8)
    g.add_argument("--sigma-response", type=float, default=0.65)
    g.add_argument("--prompt-length", type=int, default=256)
    h = p.add_argument_group("hardware efficiency")
    h.add_argument("--bandwidth", type=float, default=e.bandwidth, help="achieved share of HBM bandwidth")
    h.add_argument("--mfu", type=float, default=e.mfu)
    h.add_argument("--step-overhead-ms", type=float, default=e.step_overhead_s * 1e3)
    h.add_argument("--allreduce-us", type=float, default=e.allreduce_s * 1e6)
    h.add_argument("--mem-fraction", type=float, default=e.mem_fraction)
    c = StepCosts()
    s = p.add_argument_group("the whole step")
    s.add_argument("--end-to-end", action="store_true",
                   help="the published ablation step by step: rollout, reward, training, weight sync")
    s.add_argument("--train-mfu", type=float, help=f"training's share of peak bf16 FLOPs (default {c.mfu})")
    s.add_argument("--reward-workers", type=int, help=f"CPU workers scoring responses (default {c.reward_workers})")
    s.add_argument("--reward-hang-prompts", type=float,
                   help=f"share of prompts whose responses may hit the scorer's timeout (default {c.reward_hang_prompts})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.eta is not None:
        args.eta_p = args.eta_r = args.eta
    if args.rounds is None and args.epochs is None:
        args.rounds = d.rounds
    return args


EPOCH_FLAGS = ("epochs", "history", "rho", "drift")
STEP_FLAGS = ("train_mfu", "reward_workers", "reward_hang_prompts")


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag combinations that would be silently ignored."""
    if not args.end_to_end and (given := [f"--{n.replace('_', '-')}" for n in STEP_FLAGS if getattr(args, n) is not None]):
        raise ValueError(f"{', '.join(given)}: only with --end-to-end")
    if args.end_to_end and (args.epochs is not None or args.planner):
        raise ValueError("--end-to-end runs its own rows (the planner is one of them) over --rounds rounds: "
                         "not with --epochs or --planner")
    if args.epochs is None:
        given = [f"--{name}" for name in EPOCH_FLAGS[1:] if getattr(args, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only with --epochs")
        return
    if args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    if args.rounds is not None:
        raise ValueError("--rounds and --epochs exclude each other: --epochs runs until every epoch is trained")
    if args.trace and (args.rho is not None or args.drift is not None):
        raise ValueError("--rho and --drift shape the synthetic trace; a --trace file brings its own epochs")


def settings_of(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        model=args.model, gpus=args.gpus, tp=args.tp, p0=args.p0, r0=args.r0, eta_p=args.eta_p, eta_r=args.eta_r,
        limit=args.limit, rounds=args.rounds or SimSettings.rounds, planner=args.planner, max_tp=args.max_tp,
        seed=args.seed,
        efficiency=Efficiency(bandwidth=args.bandwidth, mfu=args.mfu, step_overhead_s=args.step_overhead_ms / 1e3,
                              allreduce_s=args.allreduce_us / 1e6, mem_fraction=args.mem_fraction))


def samples_per_prompt(args: argparse.Namespace) -> int:
    """Enough samples per prompt for a short round's over-launched responses."""
    return max(args.r0, -(-int(args.eta_r * args.r0 * 1000) // 1000))


def progress(total: int, unit: str, desc: str = "baseline + tail batching"):
    """A bar on stderr while the modes run (on a terminal only: a log file gets the report alone)."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, disable=None, leave=False)


def one_epoch_trace(args: argparse.Namespace) -> tuple[list, str]:
    """The lengths (a ``--trace`` file or the parametric model) and a line that says which."""
    if args.trace:
        return load_trace(args.trace), f"trace {args.trace}"
    median = args.median or args.limit / 28
    trace = longtail_trace(args.num_prompts, samples=samples_per_prompt(args), median=median, limit=args.limit,
                           sigma_prompt=args.sigma_prompt, sigma_response=args.sigma_response,
                           prompt_length=args.prompt_length, seed=args.seed)
    return trace, (f"log-normal: median {median:.0f} x exp(N(0,{args.sigma_prompt})) per prompt "
                   f"x exp(N(0,{args.sigma_response})) per response, clipped to {args.limit}")


def simulate(args: argparse.Namespace) -> dict:
    check_args(args)
    if args.epochs is not None:
        return simulate_epochs(args)
    if args.end_to_end:
        return simulate_steps(args)
    settings = settings_of(args)
    trace, length_model = one_epoch_trace(args)
    with progress(2 * settings.rounds, "rounds") as bar:
        baseline = run_mode("baseline", settings, trace, on_round=lambda _: bar.update())
        tail = run_mode("tail_batching", settings, trace, on_round=lambda _: bar.update())
    return {"settings": {k: v for k, v in vars(args).items() if k not in ("json", *EPOCH_FLAGS)},
            "length_model": length_model, "baseline": [row_dict(r) for r in baseline],
            "tail_batching": [row_dict(r) for r in tail], "summary": summarize(baseline, tail)}


def simulate_steps(args: argparse.Namespace) -> dict:
    settings, (trace, length_model) = settings_of(args), one_epoch_trace(args)
    given = {"mfu": args.train_mfu, "reward_workers": args.reward_workers, "reward_hang_prompts": args.reward_hang_prompts}
    costs = dataclasses.replace(StepCosts(), **{k: v for k, v in given.items() if v is not None})
    with progress(len(ABLATION) * settings.rounds, "steps", "the ablation's rows") as bar:
        steps = run_ablation(settings, trace, costs, on_round=lambda _: bar.update())
    return {"settings": {k: v for k, v in vars(args).items() if k not in ("json", *EPOCH_FLAGS, *STEP_FLAGS)},
            "length_model": length_model, "costs": dataclasses.asdict(costs),
            "steps": {key: [step_dict(r) for r in rows] for key, rows in steps.items()},
            "summary": summarize_steps(steps)}


def simulate_epochs(args: argparse.Namespace) -> dict:
    settings = settings_of(args)
    if args.trace:
        trace, length_model = load_trace(args.trace), f"trace {args.trace}"
    else:
        median = args.median or args.limit / 28
        rho, drift = (1.0 if args.rho is None else args.rho), (args.drift or 0.0)
        trace = multi_epoch_trace(args.num_prompts, args.epochs, samples=samples_per_prompt(args), median=median,
                                  limit=args.limit, sigma_prompt=args.sigma_prompt,
                                  sigma_response=args.sigma_response, rho=rho, drift=drift,
                                  prompt_length=args.prompt_length, seed=args.seed)
        length_model = (f"log-normal: median {median:.0f} x exp({args.sigma_prompt} z + {drift} epoch) per prompt, "
                        f"z AR(1) over epochs with rho {rho}, x exp(N(0,{args.sigma_response})) per response, "
                        f"clipped to {args.limit}")
    history = HistoryConfig(enabled=args.history == "on")
    with progress(2 * len(trace) * args.epochs, "prompts") as bar:
        def trained(result) -> None:
            bar.update(sum(group[0].prompt.epoch < args.epochs for group in result.groups))
        baseline = run_epochs("baseline", settings, trace, args.epochs, shuffle_seed=args.seed, on_round=trained)
        tail = run_epochs("tail_batching", settings, trace, args.epochs, history=history, shuffle_seed=args.seed,
                          on_round=trained)
    try:
        correlation = epoch_spearman(trace)
    except ValueError:  # a trace without per-epoch rows, or a single epoch
        correlation = None
    return {"settings": {k: v for k, v in vars(args).items() if k != "json"}, "length_model": length_model,
            "epoch_spearman": correlation, **compare(baseline, tail)}


def print_header(report: dict) -> None:
    s = report["settings"]
    print(f"Qwen2.5-{s['model'].upper()} on {s['gpus']} x H800, rollout TP {s['tp']}{' + planner' if s['planner'] else ''}, "
          f"P0={s['p0']} R0={s['r0']} eta_p={s['eta_p']} eta_r={s['eta_r']}, limit {s['limit']}")
    print(f"lengths: {report['length_model']}")


def print_report(report: dict) -> None:
    print_header(report)
    header = f"{'mode':<14}{'round':>6} {'kind':<9}{'tp':>3}{'rollout s':>11}{'bubble':>8}" \
             f"{'gen tok':>11}{'wasted tok':>12}{'preempt':>9}{'queue':>7}"
    print(header)
    for mode in ("baseline", "tail_batching"):
        for r in report[mode]:
            print(f"{mode:<14}{r['index']:>6} {r['kind']:<9}{r['tp']:>3}{r['rollout_seconds']:>11.1f}"
                  f"{r['bubble_fraction']:>8.2f}{r['generated_tokens']:>11}{r['wasted_tokens']:>12}"
                  f"{r['preemptions']:>9}{r['queue_length']:>7}")
    m = report["summary"]
    print(f"baseline mean {m['baseline_mean_s']:.1f} s/step (bubble {m['baseline_bubble']:.2f}, "
          f"max/median length {m['baseline_max_over_median']:.1f}); tail batching mean {m['tail_mean_s']:.1f} s/step "
          f"(short {m['short_mean_s']:.1f} s, long {m['long_mean_s']:.1f} s, bubble {m['tail_bubble']:.2f}, "
          f"wasted {100 * m['tail_wasted_fraction']:.0f}% of generated tokens)")
    print(f"speedup: amortized {m['speedup']:.2f}x, short rounds {m['short_round_speedup']:.2f}x")


def print_step_report(report: dict) -> None:
    print_header(report)
    c = report["costs"]
    print(f"{'component':<24}{'rollout s':>10}{'reward s':>10}{'train s':>9}{'sync s':>8}{'step s':>9}"
          f"{'speedup':>9}{'streamed':>10}")
    for component in ABLATION:
        m = report["summary"][component.key]
        print(f"{component.label:<24}{m['rollout_s']:>10.1f}{m['reward_s']:>10.1f}{m['train_s']:>9.1f}"
              f"{m['sync_s']:>8.1f}{m['step_s']:>9.1f}{m['speedup']:>8.2f}x{m['streamed_share']:>10.0%}")
    print(f"per step, mean of {report['settings']['rounds']} rounds; training after rollout at MFU {c['mfu']} "
          f"({c['flops_per_token']:g} x params FLOPs per token), weight sync {c['switch_s']:g} s + weights at "
          f"{c['sync_bytes_per_s'] / 1e9:g} GB/s; reward {c['reward_s']:g} s per response on {c['reward_workers']} "
          f"workers, {c['reward_hang_s']:g} s for half the responses of {c['reward_hang_prompts']:.0%} of the prompts; "
          "streamed: the share of training done by the stream trainer before the round ended")


def print_epoch_report(report: dict) -> None:
    print_header(report)
    if report["epoch_spearman"] is not None:
        print(f"epoch-to-epoch Spearman of per-prompt mean length: {report['epoch_spearman']:.2f}")
    tail = f"tail batching{' + history' if report['history'] else ''}"
    print(f"{'epoch':<7}{'baseline s':>11}{'tail s':>9}{'speedup':>9}{'wasted b':>10}{'wasted t':>10}"
          f"{'trained':>9}{'rounds b/t':>12}")
    rows = [(str(r["epoch"]), r) for r in report["per_epoch"]] + [("total", report["total"])]
    for name, r in rows:
        b, t = r["baseline"], r["tail_batching"]
        print(f"{name:<7}{b['rollout_seconds']:>11.0f}{t['rollout_seconds']:>9.0f}{r['speedup']:>8.2f}x"
              f"{b['wasted_token_fraction']:>10.1%}{t['wasted_token_fraction']:>10.1%}{t['trained_prompts']:>9}"
              f"{b['rounds']:>6.1f}/{t['rounds']:<5.1f}")
    print(f"baseline vs {tail}: same prompts trained per epoch: {report['same_prompts']}; "
          f"prompts history routed to the long queue: {report['routed']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = simulate(args)
    except (TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    elif args.epochs is not None:
        print_epoch_report(report)
    elif args.end_to_end:
        print_step_report(report)
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
