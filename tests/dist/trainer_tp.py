"""torchrun script: two GRPO steps with the model split over TP=2 (gloo); rank 0 writes the metrics.

Usage: trainer_tp.py MODEL_DIR OUT_JSON. The test compares them with the same steps at TP=1.
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


def two_steps(trainer: Trainer) -> list[dict]:
    return [trainer.train_step(random_groups(seed, num_groups=3)) for seed in (8, 9)]


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    layout = setup_layout(2, 1, 1)
    metrics = two_steps(Trainer(TrainerConfig(tp=2, **STEP_CONFIG), model_dir, layout))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(metrics, f)
    teardown_layout(layout)


if __name__ == "__main__":
    main()
