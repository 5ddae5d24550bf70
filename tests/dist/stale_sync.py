"""torchrun entry: ``rollpacker.train`` with a stale weight sync, the control for the sync checks.

From the second sync on, every rank still walks the trainer's tensor stream (the gather over TP/PP is
collective) but the engine receives the first sync's tensors again: the round samples from the
starting policy while the trainer holds step N's weights. The program's own sync checks must see it:
``sync/max_abs_diff`` (reference engine, ``run.verify_sync``) and ``train/logprob_mismatch`` (any
engine). Same arguments as ``python -m rollpacker.train``.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

    from rollpacker.runtime.engines import EngineSets

_first: dict[str, torch.Tensor] = {}


def _stale_push(self: EngineSets, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
    if not _first:
        def recorded() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                _first[name] = tensor.detach().clone()
                yield name, tensor
        return _real_push(self, recorded())
    return _real_push(self, ((name, _first[name]) for name, _ in named_tensors))


if __name__ == "__main__":
    # imported here: the reward workers run this file as their main module (see tests/dist/train_stop_at.py)
    from rollpacker import train
    from rollpacker.runtime.engines import EngineSets

    _real_push = EngineSets.push
    EngineSets.push = _stale_push
    sys.exit(train.main())
