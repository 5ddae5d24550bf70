"""RollPacker's entry point, one SPMD program on every rank.

    torchrun --nproc_per_node N -m rollpacker.train --config configs/X.yaml [section.key=value ...]

Each step: plan the round (tail batching decides short or long, the planner
its rollout TP) → wake that round's engines with the current weights →
rollout, rewards scored as responses finish → train (one optimizer step) →
metrics and checkpoint. With ``run.eval``, the weights of step N are evaluated
on ``data.eval_files`` right after step N+1's weight sync, before its rollout.
A restart with the same command resumes from the latest checkpoint.
"""
from __future__ import annotations

import logging
import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C (torchrun passes it on) before the run can checkpoint: stop quietly; from then on it asks
    # for a checkpoint at the end of the step (CheckpointManager.install_stop_handlers)
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))
    from rollpacker.runtime.preflight import parse_args

    parse_args(argv)  # --help and usage errors answer before the imports below
    if os.environ.get("RANK", "0") == "0":  # the first line, before the seconds of importing torch and Megatron
        print(f"rollpacker: {os.environ.get('WORLD_SIZE', '1')} rank(s) started: checking the config, model and "
              "data, then building engines, trainer and reward pool", file=sys.stderr, flush=True)
    # Imported here, not at the top: a forkserver or spawn child (every reward worker) runs the top
    # of the parent's main module, and torch, Megatron and transformers would cost each worker
    # seconds of CPU and hundreds of MB before it scores anything.
    from torch.distributed.elastic.multiprocessing.errors import record

    # torchrun's failure summary then names the rank that failed first, with its traceback
    return record(_train)(argv)


def _train(argv: list[str] | None) -> int:
    from megatron_ext.optional_kernels import quiet_missing_kernel_warnings
    from rollpacker.runtime.preflight import preflight

    missing_kernels = quiet_missing_kernel_warnings()  # before megatron-core is imported
    pre = preflight(argv)  # every rank refuses a bad config, model or dataset before any work
    if pre.finished_step is not None:  # every rank sees the same checkpoint and stops before any group forms
        if os.environ.get("RANK", "0") == "0":
            print(pre.finished_line(), file=sys.stderr)
        return 0

    from rollpacker.runtime.run import Run
    from rollpacker.runtime.world import World

    world = World.init(pre.cfg.run.threads_per_rank)
    logging.basicConfig(level=logging.INFO if world.rank == 0 else logging.WARNING,
                        format="%(asctime)s rollpacker %(levelname)s %(message)s", stream=sys.stderr)
    if missing_kernels and world.rank == 0:
        logging.getLogger("rollpacker").info(missing_kernels)
    run = Run(pre, world)  # groups, engines, trainer, scheduler, reward pool
    start = run.resume()
    for step in range(start + 1, pre.cfg.run.steps + 1):
        plan = run.plan_round()  # short or long round, rollout TP
        run.sync_weights()  # trainer shards -> HF tensors -> the round's engines
        run.evaluate(step - 1)  # if due: the engines now hold step-1's weights (0: the starting policy)
        result = run.rollout(plan)  # scheduler + engines + reward pool
        train_metrics = run.train(result)  # one GRPO optimizer step
        if run.end_step(step, result, train_metrics):  # metrics, ledger, checkpoint; SIGTERM stops here
            break
    else:
        run.evaluate(pre.cfg.run.steps)  # the final weights, if due (no round follows: it syncs them itself)
    run.close()
    run.summary()  # rank 0: steps, time, evals, where the files are
    world.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
