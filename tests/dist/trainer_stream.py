"""torchrun script: streamed steps equal the one-shot step, on 2 data-parallel ranks (gloo).

Usage: trainer_stream.py MODEL_DIR OUT_JSON. For each loss aggregation, one
one-shot step (``begin(); finish(all)``) and several streamed steps that feed
the same groups in a random order, a random split between the two ranks'
streams and a random remainder. Each step starts from the same weights and
optimizer state (restored from a snapshot); gradients are captured after the
DP reduction and normalisation (clipping off). Rank 0 writes the results.
"""
from __future__ import annotations

import json
import random
import sys
import time

import torch
import torch.distributed as dist

from megatron_ext.parallel import setup_layout, teardown_layout
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.trainer import Trainer
from tests.dist.trainer_fixtures import random_groups


def flat_grad(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in trainer.backend._params]).clone()


def flat_params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]).clone()


def streamed_step(trainer: Trainer, groups, rng: random.Random, rank: int, *, all_on_rank1: bool = False,
                  ended_after_first_burst: bool = False) -> dict:
    """Feed ``groups`` in a random order: some streamed on rank 0, some on rank 1, the rest at the end
    (or, with ``all_on_rank1``, every group streamed on rank 1 and nothing left for rank 0). With
    ``ended_after_first_burst`` the rollout ends right after the first burst's training, but the
    rank learns of it only after training the others too (as a late message would tell it)."""
    order = list(range(len(groups)))
    rng.shuffle(order)
    where = ["r1" if all_on_rank1 else rng.choice(["r0", "r1", "rest"]) for _ in order]
    trainer.stream.begin()
    bursts: dict[int, list] = {0: [], 1: []}  # drawn on every rank alike, so rank 0 can report rank 1's
    for r, planned in bursts.items():
        mine = [groups[i] for i, w in zip(order, where) if w == f"r{r}"]
        while mine:  # arrive in bursts of 1..3 groups
            k = rng.randint(1, 3)
            planned.append(mine[:k])
            mine = mine[k:]
    ended_at = None
    for burst in bursts[rank]:
        trainer.stream.consume(burst)
        if ended_after_first_burst and ended_at is None:
            ended_at = time.time()
    trainer.stream.end_rollout(at=ended_at)
    metrics = trainer.finish_step([groups[i] for i, w in zip(order, where) if w == "rest"])
    return {"metrics": metrics, "split": where, "bursts": [len(b) for b in bursts[1]]}


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    layout = setup_layout(1, 1, 1)
    rank = dist.get_rank()
    results = {}
    for aggregation in ("token_mean", "seq_mean"):
        cfg = TrainerConfig(lr=1e-3, grad_clip=0.0, params_dtype="fp32", micro_batch_tokens=48,
                            loss_aggregation=aggregation)
        trainer = Trainer(cfg, model_dir, layout)
        snapshot = trainer.state_dict()
        groups = random_groups(seed=3, num_groups=6)

        one_shot = trainer.train_step(groups)
        reference = flat_grad(trainer)
        params_after = flat_params(trainer)
        gathered = [torch.empty_like(params_after) for _ in range(layout.dp)]
        dist.all_gather(gathered, params_after, group=layout.dp_group)
        runs = []
        for trial in range(5):
            trainer.load_state_dict(snapshot)
            run = streamed_step(trainer, groups, random.Random(100 + trial), rank, all_on_rank1=trial in (0, 4),
                                ended_after_first_burst=trial == 4)
            grad = flat_grad(trainer)
            run["rel_grad_diff"] = float((grad - reference).norm() / reference.norm())
            run["rel_param_diff"] = float((flat_params(trainer) - params_after).norm() / params_after.norm())
            runs.append(run)
        results[aggregation] = {
            "one_shot": one_shot, "streamed": runs,
            "replicas_equal_after_step": all(torch.equal(g, gathered[0]) for g in gathered),
            "optimizer_steps": max(int(s["step"]) for s in trainer.backend.optimizer.state_dict()["state"].values()),
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    teardown_layout(layout)


if __name__ == "__main__":
    main()
