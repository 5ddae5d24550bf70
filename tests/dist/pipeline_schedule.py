"""torchrun script: Megatron's pipelined schedule (PP=2, gloo) validates the GPU backend's group arguments.

Usage: pipeline_schedule.py MODEL_DIR. megatron-core 0.16.1's pipelined schedule takes explicit process
groups only together with a p2p communicator ("provide none or provide all the process groups"). The
schedule's first call once that validation passed is the model config's ``no_sync_func`` (it disables
gradient sync before the warm-up); here it raises ``PastValidation``, so the run stops at that exact
point on CPU. Each rank prints ACCEPTED when the schedule got there with ``schedule_groups(...)``,
REFUSED when it rejected ``pg_collection`` alone (the old call), and ``OTHER ...`` for anything else.
Recorded run with the subject broken (``schedule_groups`` returning ``pg_collection`` alone): every
line read REFUSED, so tests/integration/test_trainer_procs.py's count of ACCEPTED fails.
"""
from __future__ import annotations

import sys

import torch
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

from megatron_ext.parallel import setup_layout, teardown_layout
from megatron_ext.model import build_model
from rollpacker.trainer.backend_gpu import schedule_groups


class PastValidation(Exception):
    """The schedule accepted its group arguments and went on to its first call."""


def outcome(model: torch.nn.Module, groups: dict) -> str:
    def forward_step(data_iterator, model):
        raise AssertionError("not reached: the schedule stops before its first micro-batch")

    def past_validation():
        raise PastValidation

    model.config.no_sync_func = past_validation
    try:
        forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step, data_iterator=iter([]), model=[model], num_microbatches=2,
            seq_length=8, micro_batch_size=1, forward_only=True, **groups)
    except PastValidation:
        return "ACCEPTED"
    except ValueError as exc:
        return "REFUSED" if "Invalid combination of p2p_communicator" in str(exc) else f"OTHER {exc!r}"
    except Exception as exc:  # noqa: BLE001 - printed for the test, which fails on it
        return f"OTHER {exc!r}"
    return "OTHER: returned without calling no_sync_func"


def main(model_dir: str) -> None:
    torch.set_num_threads(1)
    layout = setup_layout(1, 2, 1)
    model = build_model(model_dir, pre_process=layout.is_first_stage, post_process=layout.is_last_stage,
                        pg_collection=layout.pg_collection)
    print(outcome(model, schedule_groups(layout, model.config)), flush=True)
    print(outcome(model, {"pg_collection": layout.pg_collection}), flush=True)
    teardown_layout(layout)


if __name__ == "__main__":
    main(sys.argv[1])
