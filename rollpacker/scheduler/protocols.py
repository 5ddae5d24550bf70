"""What the scheduler needs from its collaborators, as structural protocols.

The program adapts the real components (``PromptDataset``, ``RewardPool``) to
these; tests and the simulator use the small implementations in this package
and in ``rollpacker.sim``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, runtime_checkable

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
    """The subset of ``concurrent.futures.Future`` the scheduler uses: its callback tells the
    scheduler when the score is in (the reward pool's from its thread, the simulator's when the
    virtual clock reaches it)."""

    def done(self) -> bool: ...

    def result(self) -> Score: ...

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...


class RewardSink(Protocol):
    def submit(self, sample: Sample, *, key: str | None = None, adapt: bool = True) -> ScoreFuture:
        """Start scoring a finished response; must not block on the score. ``key`` names the prompt
        whose code timeouts apply (None: one derived from its tests), ``adapt`` whether the outcome
        may adapt them (an eval's may not)."""


@runtime_checkable
class EventSource(Protocol):
    """A simulated component that can say when it will next change state.

    On a virtual clock the engine driver advances time to the earliest
    ``next_event_time`` of the round's engines (and of the reward sink, when
    it models scoring latency). ``None`` means nothing is scheduled.
    """

    def next_event_time(self) -> float | None: ...


class Fleet(Protocol):
    """How a round's engines are reached (``scheduler.fleet.LocalFleet``: in this process;
    ``control.fleet.ClusterFleet``: through the servers of the ranks that lead them). Engine ``i``
    runs its share of the round as a race; the driver makes typed calls (``scheduler.calls``) on
    them and takes their news as ``(i, RaceNews)`` pairs."""

    clock: Any
    reward: RewardSink | None

    @property
    def size(self) -> int: ...

    def open_round(self, progress: bool) -> None:
        """A round starts; ``progress``: every response generated is news, not only completed groups."""

    def close_round(self) -> None: ...

    def call(self, calls: Iterable[tuple[int, Any]]) -> list:
        """Each ``(engine, call)`` made, every call sent before any reply is awaited; the replies in
        order (the first error raised once all are in)."""

    def poll(self, wait: bool = False) -> list:
        """The news since the last look; with none and ``wait``, once some comes (or a ``wake``)."""

    def wake(self) -> None:
        """End a wait early; safe from any thread (a score came)."""

    def wait_for_time(self) -> None:
        """Wait for something other than the engines (the after-rollout stage's scores): until a
        ``wake``, the next simulated event, or briefly."""
