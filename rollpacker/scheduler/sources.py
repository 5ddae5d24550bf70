"""An in-memory ``PromptSource``: serves a fixed list of prompts epoch after epoch."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rollpacker.sample import Prompt


class ListPromptSource:
    """Serves ``prompts`` in order, wrapping around with ``epoch`` incremented.

    Used by the simulator and tests; the real run uses
    ``rollpacker.data.dataset.PromptDataset``, which has the same methods.
    """

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        if not prompts:
            raise ValueError("ListPromptSource needs at least one prompt")
        self._prompts = list(prompts)
        self._cursor = 0  # prompts served so far, over all epochs

    def take(self, n: int) -> list[Prompt]:
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0, got {n}")
        out = []
        for k in range(self._cursor, self._cursor + n):
            epoch, index = divmod(k, len(self._prompts))
            out.append(dataclasses.replace(self._prompts[index], epoch=epoch))
        self._cursor += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self._cursor, "num_prompts": len(self._prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != len(self._prompts):
            raise ValueError(f"state is for {state['num_prompts']} prompts, this source has {len(self._prompts)}")
        self._cursor = int(state["cursor"])
