"""Reference engines: each rank of the engine keeps its shard of every full tensor."""
from __future__ import annotations

import time
from typing import Iterable

import torch

from rollpacker.rollout.engine import RolloutEngine


class LocalShardSync:
    def push(self, engine: RolloutEngine, is_leader: bool,
             named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        start, nbytes = time.perf_counter(), 0
        counted = []
        for name, tensor in named_tensors:
            nbytes += tensor.numel() * tensor.element_size()
            counted.append((name, tensor))
            if len(counted) >= 16:  # keep only a few gathered tensors alive at once
                engine.load_weights_local(counted)
                counted = []
        engine.load_weights_local(counted)
        return {"sync/bytes": float(nbytes), "sync/load_s": time.perf_counter() - start}
