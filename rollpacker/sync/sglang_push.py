"""SGLang engines: the owning rank streams full tensors into ``update_weights``.

The backend groups them into size-bounded buckets for
``update_weights_from_tensor``. Ranks that own no ``sglang.Engine`` still walk
the iterator: the trainer's gather over TP/PP is collective, so every rank
must step through it in the same order.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch

from rollpacker.rollout.engine import RolloutEngine


class SGLangPushSync:
    def push(self, engine: RolloutEngine, is_leader: bool,
             named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        start, nbytes = time.perf_counter(), [0]

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                nbytes[0] += tensor.numel() * tensor.element_size()
                yield name, tensor

        if is_leader:
            engine.update_weights(counted())
        else:
            for _ in counted():
                pass
        return {"sync/bytes": float(nbytes[0]), "sync/load_s": time.perf_counter() - start}
