"""Weight sync: full HF-named tensors from the trainer's layout into rollout engines.

Every rank iterates the trainer's tensors together (the gather over training
TP and the broadcast over PP are collective); what each rank does with a
tensor depends on the engine backend, one strategy per file:

- ``local_shards``: every rank of a reference engine keeps its own shard of
  each tensor; no communication beyond the trainer's gather.
- ``sglang_push``: the rank that owns an ``sglang.Engine`` streams the tensors
  into the backend, which pushes size-bounded buckets; other ranks only iterate.
"""
from __future__ import annotations

from typing import Iterable, Protocol

import torch

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import RolloutEngine


class WeightSync(Protocol):
    def push(self, engine: RolloutEngine, is_leader: bool,
             named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load every tensor into ``engine``; returns metrics (bytes, seconds)."""


def make_weight_sync(cfg: RolloutConfig) -> WeightSync:
    if cfg.backend == "reference":
        from rollpacker.sync.local_shards import LocalShardSync
        return LocalShardSync()
    from rollpacker.sync.sglang_push import SGLangPushSync
    return SGLangPushSync()
