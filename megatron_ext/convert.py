"""Qwen2/Qwen3 checkpoint conversion and verification CLI.

    rollpacker-convert --verify HF_DIR [--tp N] [--dtype fp32|bf16]
    rollpacker-convert hf-to-mcore HF_DIR OUT [--tp N] [--pp M] [--dtype fp32|bf16]
    rollpacker-convert mcore-to-hf MCORE_DIR OUT

(or ``python -m megatron_ext.convert``). More than one rank (N = tp*pp) runs under
``torchrun --nproc_per_node N -m megatron_ext.convert ...``.

``--verify`` loads HF_DIR with ``transformers.AutoModelForCausalLM`` and with
Megatron (TP=N), runs both on a fixed random batch, prints the largest absolute
difference of per-token log-probs (and entropies) and PASS/FAIL; the exit code
is 1 on FAIL. The formats are described in ``megatron_ext.conversion``.
"""
from __future__ import annotations

import argparse
import os
import sys

from rollpacker.cli_help import HelpFormatter

DTYPES = ("bf16", "fp32")  # megatron_ext.conversion.DTYPES, named here without importing torch
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollpacker-convert", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--verify", metavar="HF_DIR", help="log-prob parity of Megatron vs transformers")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size / pp)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="parameter dtype")
    p.add_argument("--tol", type=float, default=None, help="PASS threshold (default 1e-4 fp32, 2e-2 bf16)")
    sub = p.add_subparsers(dest="command")
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors -> per-rank Megatron shards")
    to_mcore.add_argument("hf_dir")
    to_mcore.add_argument("out")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    # Also accepted after the subcommand; SUPPRESS keeps a value given before it.
    to_mcore.add_argument("--tp", type=int, default=argparse.SUPPRESS)
    to_mcore.add_argument("--dtype", choices=DTYPES, default=argparse.SUPPRESS)
    to_hf = sub.add_parser("mcore-to-hf", help="per-rank Megatron shards -> HF safetensors")
    to_hf.add_argument("mcore_dir")
    to_hf.add_argument("out")
    return p


def _ranks_line(tp: int, pp: int, world: int, argv: list[str]) -> str | None:
    """The refusal when the job's ranks are not the tp*pp the command asks for, with the command to run."""
    if tp * pp == world:
        return None
    return (f"--tp {tp} --pp {pp} needs {tp * pp} rank(s), this run has {world}: run it as "
            f"torchrun --nproc_per_node {tp * pp} -m megatron_ext.convert {' '.join(argv)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.verify is None) == (args.command is None):
        parser.error("give exactly one of --verify HF_DIR, hf-to-mcore, mcore-to-hf")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.command != "mcore-to-hf":
        pp = getattr(args, "pp", 1)
        tp = args.tp or world // pp
        if problem := _ranks_line(tp, pp, world, argv):
            parser.exit(2, f"rollpacker-convert: {problem}\n")
    from megatron_ext.optional_kernels import quiet_missing_kernel_warnings

    if (missing := quiet_missing_kernel_warnings()) and os.environ.get("RANK", "0") == "0":
        print(f"rollpacker-convert: {missing}", file=sys.stderr)
    from megatron_ext.conversion import DTYPES as TORCH_DTYPES
    from megatron_ext.conversion import hf_to_mcore, mcore_to_hf, read_mcore_meta, verify
    from megatron_ext.parallel import setup_layout, teardown_layout

    if args.command == "mcore-to-hf":
        meta = read_mcore_meta(args.mcore_dir)
        tp, pp = meta["tp"], meta["pp"]
        if problem := _ranks_line(tp, pp, world, argv):
            parser.exit(2, f"rollpacker-convert: {args.mcore_dir} was written with {problem}\n")
    layout = setup_layout(tp=tp, pp=pp)
    try:
        if args.command == "hf-to-mcore":
            hf_to_mcore(args.hf_dir, args.out, layout, dtype=args.dtype)
        elif args.command == "mcore-to-hf":
            mcore_to_hf(args.mcore_dir, args.out, layout)
        else:
            tol = args.tol if args.tol is not None else TOLERANCE[args.dtype]
            parity = verify(args.verify, layout, params_dtype=TORCH_DTYPES[args.dtype])
            ok = parity.logprob_diff < tol and parity.entropy_diff < tol
            if layout.is_writer:
                print(f"max |dlogp| = {parity.logprob_diff:.3e}  max |dH| = {parity.entropy_diff:.3e}  "
                      f"tp={tp} dtype={args.dtype} tol={tol:g}  {'PASS' if ok else 'FAIL'}", flush=True)
            return 0 if ok else 1
        if layout.is_writer:
            print(f"wrote {args.out}", flush=True)
        return 0
    finally:
        teardown_layout(layout)


if __name__ == "__main__":
    sys.exit(main())
