"""The FIFO long-prompt queue of tail batching."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable

from rollpacker.sample import Prompt


class LongPromptQueue:
    """Prompts that lost a short round's race, oldest first.

    Nothing is predicted: a prompt is here only because it was launched and
    did not become one of the P0 done prompts of its round.
    """

    def __init__(self) -> None:
        self._items: collections.deque[Prompt] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, prompts: Iterable[Prompt]) -> None:
        self._items.extend(prompts)

    def pop(self, n: int) -> list[Prompt]:
        if n > len(self._items):
            raise IndexError(f"pop({n}) from a long-prompt queue of {len(self._items)}")
        return [self._items.popleft() for _ in range(n)]

    def peek(self) -> list[Prompt]:
        return list(self._items)

    def state_dict(self) -> dict[str, Any]:
        return {"prompts": [dataclasses.asdict(p) for p in self._items]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._items = collections.deque(Prompt(**p) for p in state["prompts"])
