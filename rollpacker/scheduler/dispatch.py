"""Dispatch over a round's engines: where each group runs, what the engines tell, the end.

The driver places each launched group, all its responses, on the engine with the fewest
outstanding requests (then outstanding prompt tokens), joins the parts of a group placed on
several engines back into the group, and keeps the round's accounting. How the engines are
reached (in this process, or through the servers of the ranks that lead them) is its ``Fleet``'s
(``scheduler/fleet.py``, ``control/fleet.py``): the driver speaks typed calls to it and takes its news.

When the round is over, ``end`` ends every race, and their reports give the round's accounting:
where each request ran, the engines' busy slots, preemptions and generated tokens.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from rollpacker.rollout.engine import EngineStats
from rollpacker.sample import SampleGroup
from rollpacker.scheduler.calls import End, Launch, Retire, Stats
from rollpacker.scheduler.group_race import GroupDone, GroupLaunch, RaceNews, RaceReport
from rollpacker.scheduler.protocols import Fleet


@dataclass
class _Assembly:
    """An open group: how many parts it was placed in, those done so far."""
    expected: int
    parts: list[SampleGroup] = field(default_factory=list)


class EngineDriver:
    """Drives the round on ``fleet``'s engines."""

    def __init__(self, fleet: Fleet, *, progress: bool = False) -> None:
        """``progress``: remote races also tell of each response generated (a hand-off's trigger
        counts them), not only of completed groups."""
        if not fleet.size:
            raise ValueError("a round needs at least one rollout engine")
        self.fleet, self._clock = fleet, fleet.clock
        fleet.open_round(progress)
        self._part_keys = itertools.count()
        self._part_group: dict[int, int] = {}  # part key -> its group's key
        self._open: dict[int, _Assembly] = {}  # open group key -> its parts done so far
        self._placed: dict[int, int] = {}  # open part key -> engine index
        self._part_tokens: dict[int, int] = {}  # open part key -> its prompt tokens over its responses
        self._outbox: dict[int, list[GroupLaunch]] = defaultdict(list)  # parts placed, not yet sent
        self._load = [0] * fleet.size  # outstanding requests per engine (as it last told)
        self._tokens = [0] * fleet.size  # outstanding prompt tokens per engine
        self._retired: dict[int, float] = {}  # engine -> when it left the round
        self._backlog: list[tuple[int, RaceNews]] = []  # news handed back by a retire, for the next poll
        self.reports: dict[int, RaceReport] = {}  # engine -> its race's report, once ended or retired
        self._start = self._clock.now()
        self._ended_at: float | None = None

    @property
    def engines(self) -> int:
        return self.fleet.size

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
        news += self.fleet.poll(wait=not news and bool(self._open))
        for i, n in news:
            self._load[i] = n.open
            n.done = [done for part in n.done if (done := self._complete(i, part)) is not None]
        return news

    def wake(self) -> None:
        """End a wait in ``poll`` or ``wait_for_time`` early (from any thread): a score came."""
        self.fleet.wake()

    def wait_for_time(self) -> None:
        """Wait for something other than the engines (scores of the after-rollout stage)."""
        self.fleet.wait_for_time()

    def retire(self, indices: Sequence[int]) -> tuple[int, int]:
        """Take engines out of the round: they get no more work and are not called again; their open
        groups (or parts) go, with what they have, to the engines that stay. Returns (requests
        carried over mid-generation, the tokens they had generated)."""
        handed: list[GroupLaunch] = []
        for i, (states, report) in zip(indices, self.fleet.call((i, Retire()) for i in indices)):
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
        live = [i for i in range(self.engines) if i not in self._retired]
        stats = dict(zip(live, self.fleet.call((i, Stats()) for i in live)))
        return [stats.get(i, EngineStats()) for i in range(self.engines)]

    def end(self) -> None:
        """End every race still in the round: what is left is aborted and each reports."""
        live = [i for i in range(self.engines) if i not in self._retired]
        self.reports.update(zip(live, map(self._by_group, self.fleet.call((i, End()) for i in live))))
        self._ended_at = self._clock.now()
        self.fleet.close_round()
        self._placed.clear()
        self._open.clear()
        self._load = [0] * self.engines

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
        self.fleet.call((i, Launch(parts)) for i, parts in outbox.items())

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
