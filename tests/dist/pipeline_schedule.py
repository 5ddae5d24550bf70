"""torchrun script: Megatron's pipelined schedule (PP=2, gloo) validates the GPU backend's group arguments.

Usage: pipeline_schedule.py MODEL_DIR. megatron-core 0.16.1's pipelined schedule takes explicit process
groups only together with a p2p communicator ("provide none or provide all the process groups").
On CPU the schedule cannot run past its own ``device="cuda"`` token counter, which it allocates right
after that validation; so each rank prints ACCEPTED when the schedule got past validation with
``schedule_groups(...)`` and REFUSED when it rejected ``pg_collection`` alone (the old call).
"""
from __future__ import annotations

import sys

import torch
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

from megatron_ext.parallel import setup_layout, teardown_layout
from megatron_ext.model import build_model
from rollpacker.trainer.backend_gpu import schedule_groups


def outcome(model: torch.nn.Module, groups: dict) -> str:
    def forward_step(data_iterator, model):
        raise AssertionError("not reached on CPU")

    try:
        forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step, data_iterator=iter([]), model=[model], num_microbatches=2,
            seq_length=8, micro_batch_size=1, forward_only=True, **groups)
    except ValueError as exc:
        return "REFUSED" if "Invalid combination of p2p_communicator" in str(exc) else f"OTHER {exc}"
    except (AssertionError, RuntimeError) as exc:  # the CUDA allocation after validation
        return "ACCEPTED" if "CUDA" in str(exc) else f"OTHER {exc}"
    return "ACCEPTED"


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
