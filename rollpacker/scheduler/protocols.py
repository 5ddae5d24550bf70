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


class RemoteRace(Protocol):
    """The race of an engine that another rank serves (``control.engine_client.EngineClient``): its
    server pushes the race's news to a bell shared with the round's other remote races, where the
    driver takes it, and ``begin`` sends a call (``scheduler.calls``) and returns what waits for
    its reply, so that a driver reaches N engines in about one round trip, not N."""

    bell: Any

    def begin(self, call: Any) -> Callable[[], Any]: ...

    def check_alive(self) -> None:
        """Raises if the serving rank has gone."""
