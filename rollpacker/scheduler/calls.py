"""The calls the driver makes on an engine's race, and their replies: small typed messages.

The same calls reach a race in rank 0's process (``apply``) and one that another rank's
``EngineServer`` runs (sent by its ``EngineClient``, ``rollpacker/control/``), so the driver speaks
one language to both and knows no transport.
A round's identity travels once, as the ``RoundContext`` of the first launch an engine gets in it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Union

if TYPE_CHECKING:
    from rollpacker.scheduler.group_race import GroupLaunch, GroupRace


class StopReason(enum.Enum):
    """Why an engine server's loop returns its rank to the SPMD program."""

    ROUND_END = "round_end"  # the round is over
    TO_TRAINING = "to_training"  # its ranks were handed to the stream trainer mid-round


@dataclass(frozen=True)
class RoundContext:
    """Who an engine is in a round and where its news goes, sent with its first launch of the round."""

    index: int  # the round's count on rank 0's news inbox: every push carries it, later ones drop the stale
    engine: int  # the engine's index in the round (how its news is attributed)
    inbox_address: str  # where its server pushes the race's news (tcp://host:port)
    progress: bool  # also push each response generated (a round that may hand off counts them)
    coordinator_now: float  # rank 0's clock at the launch: the server's race runs on it

    @property
    def tag(self) -> bytes:
        return b"%d" % self.index


@dataclass(frozen=True)
class Launch:
    """Race these groups (or parts of groups) on the engine."""

    groups: list[GroupLaunch]
    round: RoundContext | None = None  # with an engine's first launch of a round


@dataclass(frozen=True)
class End:
    """The round is over: abort what is left and report (``RaceReport``); a server stops serving."""


@dataclass(frozen=True)
class Retire:
    """The engine goes to the stream trainer: its open groups come back with its report; a server
    stops serving (``StopReason.TO_TRAINING``)."""


@dataclass(frozen=True)
class Stats:
    """The engine's ``EngineStats``."""


Call = Union[Launch, End, Retire, Stats]


@dataclass(frozen=True)
class Reply:
    value: Any = None
    error: str | None = None  # the server's exception, as text
    refused: tuple[str, ...] | None = None  # with ``error``: the engine refused these requests (``RequestError``)


def apply(race: GroupRace, call: Call) -> Any:
    """What ``call`` does to ``race``, wherever the race runs."""
    if isinstance(call, Launch):
        return race.launch(call.groups)
    if isinstance(call, End):
        return race.end()
    if isinstance(call, Retire):
        return race.retire()
    if isinstance(call, Stats):
        return race.stats()
    raise TypeError(f"a race cannot take {call!r}")


def stop_reason(call: Call) -> StopReason | None:
    """Whether answering ``call`` ends a server's loop (and its round), and why."""
    return {End: StopReason.ROUND_END, Retire: StopReason.TO_TRAINING}.get(type(call))


def replies(pending: Iterable[Callable[[], Any]]) -> list:
    """Each pending call's reply, in order. Every reply is awaited even when one is an error (a
    channel left without its reply could not be used again); then the first error is raised."""
    results, error = [], None
    for reply in list(pending):
        try:
            results.append(reply())
        except Exception as exc:  # noqa: BLE001 - raised once every reply is in
            error = error or exc
            results.append(None)
    if error is not None:
        raise error
    return results
