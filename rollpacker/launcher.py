"""``rollpacker-train``: check the run once, then start its ranks with torchrun's launcher.

    rollpacker-train --nproc-per-node 2 --config configs/tiny-cpu.yaml [section.key=value ...]

The same program as ``torchrun --nproc_per_node N -m rollpacker.train ...``, with a console a
person can read: the config, model and data are checked here before any rank starts (a refusal
is one message and exit code 2), a finished run says so and exits 0, a failed rank is named in
one line (its traceback is above it and in the run's ``logs/``), and Ctrl-C lets the ranks finish
and checkpoint the current step (torchrun gives them 30 s, then kills them) before it says where
the next run resumes. Multi-node jobs pass ``--nnodes`` and a rendezvous (launch/train.sh).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from rollpacker.cli_help import HelpFormatter
from rollpacker.runtime.preflight import REFUSED, Ranks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollpacker-train", description="Check a training run once, then start its "
                                "ranks with torchrun's launcher (one SPMD program per rank).",
                                formatter_class=HelpFormatter)
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny-cpu.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. trainer.lr=1e-6")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node (one per GPU)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job; > 1 needs --rdzv-endpoint")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the first node's rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default="rollpacker", help="the job's rendezvous id (multi-node)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restarts of all ranks after a rank fails (each resumes from the latest checkpoint)")
    args = p.parse_args(argv)
    if args.nproc_per_node < 1 or args.nnodes < 1:
        p.error("--nproc-per-node and --nnodes must be >= 1")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        p.error("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the first node's address)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = args.nproc_per_node * args.nnodes
    print(f"rollpacker: {args.config}: {world} rank(s); checking the config, model and data", file=sys.stderr,
          flush=True)
    from rollpacker.runtime.preflight import preflight

    rank_argv = ["--config", args.config, *args.overrides]
    node = int(os.environ.get("SLURM_NODEID", 0))  # launch/train.sh: one launcher per node; the first one reports
    pre = preflight(rank_argv, Ranks(world, args.nproc_per_node, rank=node * args.nproc_per_node))
    if pre.finished_step is not None:
        print(pre.finished_line(), file=sys.stderr)
        return 0
    return launch(args, rank_argv, pre.run_dir)


def launch(args: argparse.Namespace, rank_argv: list[str], run_dir: Path) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun would set, without its banner
    # torchrun's warnings (each signal it passes on, each rank it stops) and its failure report (a
    # 40-line traceback of this process) give way to the one-line reports below; its errors stay
    # (a rank that died, which --max-restarts then restarts, is one line)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_args
    from torch.distributed.run import run as torchrun

    for name, logger in logging.root.manager.loggerDict.items():  # each sets its own level on import
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.ERROR)

    rendezvous = (["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
                  if args.rdzv_endpoint else ["--standalone"])
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        torchrun(torchrun_args([
            "--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node), *rendezvous,
            "--max-restarts", str(args.max_restarts), "--log-dir", str(logs),
            "-m", "rollpacker.train", *rank_argv]))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode == REFUSED:
            return REFUSED  # the rank printed its one message
        cause = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        where = f"; its traceback is above and in {failure.error_file}" if os.path.isfile(failure.error_file) else ""
        print(f"rollpacker: rank {rank} failed ({cause}){where}", file=sys.stderr)
        return 1
    except SignalException as exc:
        print(f"rollpacker: {interrupted(run_dir)}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def interrupted(run_dir: Path) -> str:
    """Where an interrupted run stands: the last step logged, and the step the next run starts at."""
    from rollpacker.checkpoint import CheckpointManager

    path = run_dir / "metrics.jsonl"
    logged = [json.loads(line)["step"] for line in path.read_text().splitlines() if line] if path.exists() else []
    last = max(logged, default=0)
    checkpoint = CheckpointManager(run_dir).latest() or 0
    if last and checkpoint >= last:
        return f"interrupted after step {last}, which is checkpointed; the next run resumes from step {last + 1}"
    redone = f" (steps {checkpoint + 1}-{last} are trained again)" if last > checkpoint else ""
    return f"interrupted at step {last + 1}; the next run resumes from step {checkpoint + 1}{redone}"

if __name__ == "__main__":
    sys.exit(main())
