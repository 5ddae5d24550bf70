"""An in-memory ``PromptSource``: serves a fixed list of prompts epoch after epoch."""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Sequence

from rollpacker.sample import Prompt


class ListPromptSource:
    """Serves ``prompts`` in order, wrapping around with ``epoch`` incremented.

    ``shuffle_seed`` set: each epoch serves its own permutation, seeded by
    ``shuffle_seed + epoch`` as ``PromptDataset`` does, so the cursor alone
    still resumes exactly. Used by the simulator and tests; the real run uses
    ``rollpacker.data.dataset.PromptDataset``, which has the same methods.
    """

    def __init__(self, prompts: Sequence[Prompt], *, shuffle_seed: int | None = None) -> None:
        if not prompts:
            raise ValueError("ListPromptSource needs at least one prompt")
        self._prompts = list(prompts)
        self._shuffle_seed = shuffle_seed
        self._cursor = 0  # prompts served so far, over all epochs
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation), the last one drawn

    def take(self, n: int) -> list[Prompt]:
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0, got {n}")
        out = []
        for k in range(self._cursor, self._cursor + n):
            epoch, position = divmod(k, len(self._prompts))
            out.append(dataclasses.replace(self._prompts[self._index(epoch, position)], epoch=epoch))
        self._cursor += n
        return out

    def _index(self, epoch: int, position: int) -> int:
        if self._shuffle_seed is None:
            return position
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self._prompts)))
            random.Random(self._shuffle_seed + epoch).shuffle(order)
            self._order = (epoch, order)
        return self._order[1][position]

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self._cursor, "num_prompts": len(self._prompts), "shuffle_seed": self._shuffle_seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != len(self._prompts):
            raise ValueError(f"state is for {state['num_prompts']} prompts, this source has {len(self._prompts)}")
        if state.get("shuffle_seed") != self._shuffle_seed:
            raise ValueError(f"state was saved with shuffle_seed {state.get('shuffle_seed')}, "
                             f"this source has {self._shuffle_seed}")
        self._cursor = int(state["cursor"])
