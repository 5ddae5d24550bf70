"""Dispatch over a round's engines: where each group runs, what the engines tell, the end.

Every engine runs its share of the round as a ``GroupRace`` (group_race.py): an engine in this
process (rank 0's own, a modeled one) is wrapped in one here, and an engine that another rank
leads runs its race inside that rank's ``EngineServer``, reached through an ``EngineClient``
(``rollpacker/control/``) whose server pushes its news to the bell the round's remote races share. The
driver places each launched group, all its responses, on the engine with the fewest outstanding
requests (then outstanding prompt tokens), steps the races it holds, and takes what reached
the bell; with nothing new it sleeps on the bell until a server pushes or a score ``wake``s it,
never on a timer. On a ``VirtualClock`` nothing moves by itself: the driver asks every
``EventSource`` (modeled engines, a reward model with latency) for its next event, advances the
clock to the earliest, then steps every race, whose engine simulates itself up to the new time.

When the round is over, ``end`` ends every race, and their reports give the round's accounting:
where each request ran, the engines' busy slots, preemptions and generated tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from rollpacker.scheduler.calls import Call, End, Launch, Retire, Stats, apply
from rollpacker.rollout.engine import EngineStats, RolloutEngine
from rollpacker.scheduler.clock import Clock, VirtualClock
from rollpacker.sample import SampleGroup
from rollpacker.scheduler.group_race import GroupDone, GroupLaunch, GroupRace, RaceNews, RaceReport
from rollpacker.scheduler.protocols import EventSource, RewardSink

# a remote race's server is checked for a hang-up after this long without news: a dead rank
# pushes nothing, and its socket's hang-up is only seen when looked at
_LIVENESS_AFTER_S = 5.0


@dataclass
class _Assembly:
    """An open group: how many parts it was placed in, those done so far."""
    expected: int
    parts: list[SampleGroup] = field(default_factory=list)


class StalledError(RuntimeError):
    """Groups are open but nothing can make progress (virtual clock)."""


class EngineDriver:
    """``engines``: in-process ``RolloutEngine``s (raced here, scored by ``reward``) and remote races
    (``protocols.RemoteRace``)."""

    def __init__(self, engines: Sequence[object], clock: Clock, *, reward: RewardSink | None = None,
                 idle_poll_s: float = 0.005, event_sources: Sequence[object] = (), progress: bool = False) -> None:
        """``progress``: remote races also tell of each response generated (a hand-off's trigger
        counts them), not only of completed groups."""
        if not engines:
            raise ValueError("a round needs at least one rollout engine")
        self._clock = clock
        self._idle_poll_s = idle_poll_s
        self._virtual = isinstance(clock, VirtualClock)
        self._local = [i for i, e in enumerate(engines) if isinstance(e, RolloutEngine)]
        if self._local and reward is None:
            raise ValueError("engines raced in this process need a reward sink")
        if self._virtual:
            not_simulated = [i for i in self._local if not isinstance(engines[i], EventSource)]
            if not_simulated or len(self._local) < len(engines):
                raise TypeError(f"engines {not_simulated or 'served by other ranks'} cannot tell their next event; "
                                "a VirtualClock needs simulated engines in this process")
        self._races = [GroupRace(e, reward, clock, wake=self.wake) if i in self._local else e
                       for i, e in enumerate(engines)]
        self._event_sources = [*(engines[i] for i in self._local),
                               *(s for s in event_sources if isinstance(s, EventSource))]
        remote = [i for i in range(len(engines)) if i not in self._local]
        bells = {id(engines[i].bell): engines[i].bell for i in remote}
        if len(bells) > 1:
            raise ValueError("a round's remote engines must share one bell")
        self._bell = next(iter(bells.values()), None)
        # in-process engines that tell when they have a completion: the driver sleeps on them with the bell
        self._ringing = {i for i in self._local if engines[i].ready_fd() is not None}
        if self._bell is not None:  # what the bell still gets from an earlier driver's round is stale
            self._bell.new_round(progress)
            self._bell.watch([engines[i].ready_fd() for i in self._ringing])
        self._pipelined = set(remote)  # a remote race's calls are sent before any reply is awaited
        self._last_news = time.monotonic()
        self._next_blocking = 0
        self._part_keys = itertools.count()
        self._part_group: dict[int, int] = {}  # part key -> its group's key
        self._open: dict[int, _Assembly] = {}  # open group key -> its parts done so far
        self._placed: dict[int, int] = {}  # open part key -> engine index
        self._part_tokens: dict[int, int] = {}  # open part key -> its prompt tokens over its responses
        self._outbox: dict[int, list[GroupLaunch]] = defaultdict(list)  # parts placed, not yet sent
        self._load = [0] * len(engines)  # outstanding requests per engine (as it last told)
        self._tokens = [0] * len(engines)  # outstanding prompt tokens per engine
        self._retired: dict[int, float] = {}  # engine -> when it left the round
        self._backlog: list[tuple[int, RaceNews]] = []  # news handed back by a retire, for the next poll
        self.reports: dict[int, RaceReport] = {}  # engine -> its race's report, once ended or retired
        self._start = clock.now()
        self._ended_at: float | None = None

    @property
    def engines(self) -> int:
        return len(self._races)

    @property
    def open_groups(self) -> int:
        """Groups launched and not yet reported complete."""
        return len(self._open)

    @property
    def outstanding(self) -> int:
        """Requests outstanding over every engine, as each last told."""
        return sum(self._load)

    def launch(self, groups: Iterable[GroupLaunch], limit: int | None = None) -> int:
        """Place each group and send each engine its share in one call. A group whose responses race
        (r0 of more) goes whole to the engine with the fewest outstanding requests (then prompt
        tokens): its race runs there. A group whose responses all count (a long round's, a
        baseline's, an eval's) goes in parts of one response, each placed so: its slowest responses
        then decode on several engines, not all on one (on the simulator's published settings,
        whole groups made long rounds 3-9% longer). ``limit``: no engine is given more than that
        many outstanding requests; placing stops at the first group that does not fit. Returns how
        many groups were placed."""
        placed = 0
        for g in groups:
            if g.key in self._open:
                raise ValueError(f"group {g.key} is already open")
            parts = self._parts(g)
            if not self._place(parts, limit):
                break
            self._open[g.key] = _Assembly(len(parts))
            for part in parts:
                self._part_group[part.key] = g.key
            placed += 1
        self._send()
        return placed

    def poll(self) -> list[tuple[int, RaceNews]]:
        """Advance the engines; each engine's news since the last poll, as (engine index, news), its
        completed parts joined into the groups they complete."""
        news, self._backlog = self._backlog, []
        if self._virtual:
            self._advance_virtual_clock()
        news += self._step_local(0.0)
        if not news and self._open:
            news = self._wait()
        elif self._bell is not None:
            news += self._bell.collect()
        for i, n in news:
            self._load[i] = n.open
            n.done = [done for part in n.done if (done := self._complete(i, part)) is not None]
        if news:
            self._last_news = time.monotonic()
        return news

    def wake(self) -> None:
        """End a wait in ``poll`` or ``wait_for_time`` early (from any thread): a score came.
        Without a bell the waits are short anyway."""
        if self._bell is not None:
            self._bell.wake()

    def wait_for_time(self) -> None:
        """Wait for something other than the engines (scores of the after-rollout stage): on a
        virtual clock, move to the next simulated event; with a bell, until ``wake``; else briefly."""
        if self._virtual:
            self._advance_virtual_clock()
        elif self._bell is not None:
            self._bell.collect(_LIVENESS_AFTER_S)
        else:
            time.sleep(self._idle_poll_s)

    def retire(self, indices: Sequence[int]) -> tuple[int, int]:
        """Take engines out of the round: they get no more work and are not called again; their open
        groups (or parts) go, with what they have, to the engines that stay. Returns (requests
        carried over mid-generation, the tokens they had generated)."""
        handed: list[GroupLaunch] = []
        for i, (states, report) in zip(indices, self._each((i, Retire()) for i in indices)):
            self.reports[i] = self._by_group(report)
            self._backlog += [(i, n) for n in report.undelivered]
            self._retired[i] = self._clock.now()
            for part in states:
                del self._placed[part.key]
                self._tokens[i] -= self._part_tokens.pop(part.key)
            self._load[i] = 0
            handed += states
        self._place(handed, None)
        self._send()
        moved = [part.migrated() for part in handed]
        return sum(r for r, _ in moved), sum(t for _, t in moved)

    def stats(self) -> list[EngineStats]:
        """Each engine's stats; a retired engine reports nothing in use and no capacity."""
        live = [i for i in range(len(self._races)) if i not in self._retired]
        stats = dict(zip(live, self._each((i, Stats()) for i in live)))
        return [stats.get(i, EngineStats()) for i in range(len(self._races))]

    def end(self) -> None:
        """End every race still in the round: what is left is aborted and each reports."""
        live = [i for i in range(len(self._races)) if i not in self._retired]
        self.reports.update(zip(live, map(self._by_group, self._each((i, End()) for i in live))))
        self._ended_at = self._clock.now()
        if self._bell is not None:
            self._bell.watch([])
        self._placed.clear()
        self._open.clear()
        self._load = [0] * len(self._races)

    def bubble_fraction(self) -> float:
        """The idle share of the engines' slot-time (``RoundStats``); a retired engine's slots count
        only until it left the round (its ranks then train)."""
        end = self._clock.now() if self._ended_at is None else self._ended_at
        slot_seconds = sum(r.peak * (self._retired.get(i, end) - self._start) for i, r in self.reports.items())
        busy = sum(r.busy_seconds for r in self.reports.values())
        return 0.0 if slot_seconds <= 0 else max(0.0, 1.0 - busy / slot_seconds)

    def counters(self) -> tuple[int, int]:
        """(preemptions, generated tokens) of the round, from the races' reports."""
        return (sum(r.preemptions for r in self.reports.values()),
                sum(r.generated_tokens for r in self.reports.values()))

    def retired_at(self, i: int) -> float | None:
        return self._retired.get(i)

    # --- internals ---------------------------------------------------------------------------------
    def _parts(self, g: GroupLaunch) -> list[GroupLaunch]:
        """What of ``g`` each engine races: all of it, or (no race among its responses) one response a part."""
        def part(**changes) -> GroupLaunch:  # with containers of its own: a race fills them on a retire
            return dataclasses.replace(g, key=next(self._part_keys), ready=[], unscored=[], partial={}, **changes)

        if g.ready or g.unscored or g.partial:
            raise ValueError(f"group {g.key} arrives with responses done: only a retire carries those over")
        return [part()] if g.r0 < g.n else [part(responses=(r,), r0=1) for r in g.indices]

    def _place(self, parts: list[GroupLaunch], limit: int | None) -> bool:
        """Put each part on the least loaded engine that stays (all of them, or none where one would
        go past ``limit``); their calls wait for ``_send``."""
        heap = [(load, toks, i) for i, (load, toks) in enumerate(zip(self._load, self._tokens))
                if i not in self._retired]
        heapq.heapify(heap)
        where = []
        for part in parts:
            load, toks, i = heap[0]
            n = len(part.indices) - len(part.ready) - len(part.unscored)
            if limit is not None and load + n > limit:
                return False
            tokens = n * len(part.prompt.input_ids)
            heapq.heapreplace(heap, (load + n, toks + tokens, i))
            where.append((part, i, n, tokens))
        for part, i, n, tokens in where:
            self._outbox[i].append(part)
            self._placed[part.key], self._part_tokens[part.key] = i, tokens
            self._load[i] += n
            self._tokens[i] += tokens
        return True

    def _send(self) -> None:
        outbox, self._outbox = self._outbox, defaultdict(list)
        self._each((i, Launch(parts)) for i, parts in outbox.items())

    def _complete(self, engine: int, done: GroupDone) -> GroupDone | None:
        """A part is done: its group, when that was its last open part (None: not yet, or reported before)."""
        if self._placed.pop(done.key, None) is None:
            return None
        self._tokens[engine] -= self._part_tokens.pop(done.key)
        key = self._part_group[done.key]
        group = self._open[key]
        group.parts.append(done.group)
        if len(group.parts) < group.expected:
            return None
        del self._open[key]
        return GroupDone(key, group.parts[0] if len(group.parts) == 1 else SampleGroup.joined(group.parts))

    def _by_group(self, report: RaceReport) -> RaceReport:
        """``report`` with its spans by group (a race keys them by its parts)."""
        spans: dict[int, list] = defaultdict(list)
        for part, held in report.spans.items():
            spans[self._part_group[part]] += held
        report.spans = dict(spans)
        return report

    def _step_local(self, timeout: float) -> list[tuple[int, RaceNews]]:
        out = []
        for i in self._local:
            if i not in self._retired and (news := self._races[i].step(timeout)):
                out.append((i, news))
        return out

    def _wait(self) -> list[tuple[int, RaceNews]]:
        """Nothing new here: block on an in-process engine that must be polled for its work (round
        robin), else sleep on the bell until a server pushes, a score wakes it (one that came since
        the in-process races looked left the bell readable: no sleep then) or an in-process engine
        has a completion, else (no bell) step an engine or sleep briefly."""
        generating = [i for i in self._local if i not in self._retired and self._races[i].generating
                      and (self._bell is None or i not in self._ringing)]
        if generating:
            i = generating[self._next_blocking % len(generating)]
            self._next_blocking += 1
            news = self._races[i].step(self._idle_poll_s)
            return ([(i, news)] if news else []) + (self._bell.collect() if self._bell is not None else [])
        if self._bell is not None:
            news = self._bell.collect(max(0.001, self._last_news + _LIVENESS_AFTER_S - time.monotonic()))
            if not news and not self._bell.woken and time.monotonic() - self._last_news >= _LIVENESS_AFTER_S:
                for i, race in enumerate(self._races):
                    if i not in self._local and i not in self._retired:
                        race.check_alive()
                self._last_news = time.monotonic()
            return news
        if not self._virtual:
            time.sleep(self._idle_poll_s)
        return []

    def _each(self, calls: Iterable[tuple[int, Call]]) -> list:
        """Each ``(engine index, call)`` made on its race, their results in order. Every pipelined
        (remote) race gets its call before any reply is awaited (local ones are called then); each
        reply is awaited even when one is an error (a channel left without its reply could not be
        used again), then the first error is raised."""
        pending = [self._races[i].begin(call) if i in self._pipelined
                   else functools.partial(apply, self._races[i], call) for i, call in calls]
        results, error = [], None
        for reply in pending:
            try:
                results.append(reply())
            except Exception as exc:  # noqa: BLE001 - raised once every reply is in
                error = error or exc
                results.append(None)
        if error is not None:
            raise error
        return results

    def _advance_virtual_clock(self) -> None:
        retired = {id(self._races[i].engine) for i in self._retired}
        times = [t for t in (s.next_event_time() for s in self._event_sources if id(s) not in retired)
                 if t is not None]
        if not times:
            raise StalledError(f"{self.open_groups} groups open but no simulated event is scheduled")
        now = self._clock.now()
        self._clock.advance_to(max(now, min(times)))  # type: ignore[attr-defined]
