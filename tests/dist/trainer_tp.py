"""torchrun script: two GRPO steps with the model split over 2 ranks (gloo); rank 0 writes the metrics.

Usage: trainer_tp.py MODEL_DIR OUT_JSON [tp|ep]. ``tp`` (the default): TP=2. ``ep``: a mixture-of-experts
model's experts split over EP=2, its dense layers data-parallel over the same ranks. The test compares
them with the same steps on one rank.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megatron_ext.parallel import setup_layout, teardown_layout
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.trainer import Trainer
from tests.dist.trainer_fixtures import random_groups

STEP_CONFIG = dict(lr=1e-2, params_dtype="fp32", micro_batch_tokens=64, kl_coef=0.1)
# The load-balancing loss of a micro-batch is not linear in its tokens: one rank's packing of the
# step and two ranks' give different sums. Without it the steps are the same computation.
EP_STEP_CONFIG = dict(STEP_CONFIG, moe_aux_loss_coef=0.0, stream=False)
SPLITS = {"tp": (dict(tp=2), STEP_CONFIG), "ep": (dict(ep=2), EP_STEP_CONFIG)}


def two_steps(trainer: Trainer) -> list[dict]:
    return [trainer.train_step(random_groups(seed, num_groups=3)) for seed in (8, 9)]


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    sizes, step_config = SPLITS[sys.argv[3] if len(sys.argv) > 3 else "tp"]
    torch.set_num_threads(1)
    layout = setup_layout(**sizes)
    metrics = two_steps(Trainer(TrainerConfig(**sizes, **step_config), model_dir, layout))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(metrics, f)
    teardown_layout(layout)


if __name__ == "__main__":
    main()
