"""What the scheduler needs from its collaborators, as structural protocols.

The program adapts the real components (``PromptDataset``, ``RewardPool``) to
these; tests and the simulator use the small implementations in this package
and in ``rollpacker.sim``.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from rollpacker.sample import Prompt, Sample


class PromptSource(Protocol):
    """An endless, checkpointable stream of prompts (wrapping over epochs)."""

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts, in order; always exactly ``n``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Score(Protocol):
    reward: float
    correct: bool | None
    reason: str


class ScoreFuture(Protocol):
    """The subset of ``concurrent.futures.Future`` the scheduler uses. A future that also has
    ``add_done_callback`` (the reward pool's) tells the scheduler when it is done; others are asked."""

    def done(self) -> bool: ...

    def result(self) -> Score: ...


class RewardSink(Protocol):
    def submit(self, sample: Sample) -> ScoreFuture:
        """Start scoring a finished response; must not block on the score."""


@runtime_checkable
class EventSource(Protocol):
    """A simulated component that can say when it will next change state.

    On a virtual clock the engine driver advances time to the earliest
    ``next_event_time`` of the round's engines (and of the reward sink, when
    it models scoring latency). ``None`` means nothing is scheduled.
    """

    def next_event_time(self) -> float | None: ...


@runtime_checkable
class Announcing(Protocol):
    """A remote engine whose server pushes its completions to a bell shared with others
    (``coordinator.Bell``): the driver takes them from there instead of polling it, and waits on
    the bell rather than on an engine. ``bell`` None: polled on every sweep like any engine."""

    bell: Any



@runtime_checkable
class Pipelined(Protocol):
    """An engine reached over a channel whose calls can overlap: ``begin`` sends one and returns
    what waits for its reply, so a driver reaches N engines in about one round trip, not N."""

    def begin(self, method: str, *args: Any) -> Callable[[], Any]: ...
