"""One round, executed: launch, race to ``target_groups`` kept groups, close.

The same runner serves every mode and round kind. Each launched prompt's *group* goes whole to
one engine, whose race (group_race.py) completes it when ``r0`` of its responses have finished
generation and, with asynchronous reward, scoring; those ``r0`` samples, in the order they
completed, are the group, and its other requests are aborted on the spot. (Where no response
races, r0 of r0, the driver spreads a group's responses over engines and joins them.) Here the policy keeps
the group or filters it (then a replacement may be launched). When ``target_groups`` groups are
kept the round closes: every engine aborts what it still runs (partial tokens discarded) and
each launched prompt whose group had not been reported complete is deferred, in launch order —
including one whose last responses had finished but were not yet scored, or whose completion was
still on its way. A baseline or long round launches exactly ``r0`` responses for
``target_groups`` prompts, so it closes only when every response has finished.

A long round may hand engines to the stream trainer midway (``handoff``, see handoff.py), checked
at each response generated: what they still race is taken back with what it has and launched on
the engines that stay, the partial responses continuing from their tokens under the same request ids.

Under the deterministic race (``logical``; group_race.py) a group reports its mark, and the runner
keeps groups in mark order: a reported group is kept once no engine's floor (the least mark an open
group could still get) is below its mark, so the ``target_groups`` kept are those of the least marks
whatever the order their news arrived in; reported groups not kept by the close are deferred like
the unreported. Kept groups then train in launch order, their samples in response order.

With synchronous reward (the "reward after rollout" ablation), a group completes on generation
alone and the kept samples are scored in one stage after the round closes; ``on_group_done``
then fires after that stage.

Where each group runs is the ``EngineDriver``'s (below): it places each launched group, all its
responses, on the engine with the fewest outstanding requests (then outstanding prompt tokens),
joins the parts of a group placed on several engines back into the group, and keeps the round's
accounting (where each request ran, the engines' busy slots, preemptions, generated tokens). How
the engines are reached (in this process, or through the servers of the ranks that lead them) is
its ``Fleet``'s (``scheduler/fleet.py``, ``control/fleet.py``): the driver makes typed calls on it
and takes its news.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from rollpacker.rollout.engine import EngineStats
from rollpacker.sample import Prompt, Sample, SampleGroup
from rollpacker.scheduler.calls import End, Launch, Retire, Stats
from rollpacker.scheduler.fleet import StalledError
from rollpacker.scheduler.group_race import GroupDone, GroupLaunch, Mark, RaceNews, RaceReport
from rollpacker.scheduler.handoff import HandoffTrigger
from rollpacker.scheduler.protocols import Fleet
from rollpacker.scheduler.round import Outcome, RequestTrace, RoundPlan, RoundResult, RoundStats, RoundTrace

GroupCallback = Callable[[SampleGroup], None]


@dataclass
class _Group:
    prompt: Prompt
    n: int  # responses launched
    launched_at: float
    done: SampleGroup | None = None  # reported complete: its r0, in the order they became ready
    complete: bool = False
    kept: bool = False


class RoundRunner:
    """Runs ``plan`` on ``driver``'s engines: ``launches`` at the start (their keys are the runner's
    to give), ``replacement()`` for each group ``keeps`` filters (None: none). ``limit``: no engine
    holds more outstanding requests; launches that do not fit wait for room (an eval's many)."""

    def __init__(self, plan: RoundPlan, *, driver: EngineDriver, launches: Sequence[GroupLaunch], async_reward: bool,
                 keeps: Callable[[SampleGroup], bool], replacement: Callable[[], GroupLaunch | None],
                 on_group_done: GroupCallback | None, handoff: HandoffTrigger | None = None,
                 limit: int | None = None, logical: bool = False) -> None:
        self.plan, self.driver, self.launches, self.limit = plan, driver, launches, limit
        self.reward, self.clock = driver.fleet.reward, driver.fleet.clock
        self.async_reward = async_reward
        self.keeps, self.replacement, self.on_group_done = keeps, replacement, on_group_done
        self.waiting: collections.deque[GroupLaunch] = collections.deque()  # launched, not yet placed
        self.groups: list[_Group] = []  # launch order; a group's key is its index here
        self.kept: list[SampleGroup] = []
        self.filtered: list[Prompt] = []
        self.filtered_tokens: list[int] = []
        self.handoff = handoff
        self.finished = [0, 0]  # responses generated, their tokens
        self.migrated = [0, 0]  # requests moved off released engines, the tokens they carried
        self.handed_off: tuple[float, tuple[int, ...]] | None = None  # when, which engines
        self.logical = logical
        self.marked: list[tuple[Mark, int]] = []  # logical: reported groups not yet kept, as a heap of (mark, key)

    def run(self) -> RoundResult:
        start = self.clock.now()
        self._launch(*self.launches)  # one call per engine, not per prompt and engine
        while not self._closed():
            if not self.driver.open_groups:
                raise StalledError(f"round {self.plan.index}: {len(self.kept)}/{self.plan.target_groups} groups "
                                   "kept and nothing left running")
            for _, news in self.driver.poll():
                self._hear(news)
            # after the whole poll: the engines' floors are as of its last news, which may report groups
            # that come before the marked ones
            self._keep_marked()
            self._place()
        self.driver.end()
        rollout_end = self.clock.now()
        bubble = self.driver.bubble_fraction()
        if not self.async_reward:
            self._score_after_rollout()
        return self._result(start, rollout_end, bubble)

    def _launch(self, *launches: GroupLaunch) -> None:
        now = self.clock.now()
        for g in launches:
            self.waiting.append(dataclasses.replace(g, key=len(self.groups)))
            self.groups.append(_Group(g.prompt, g.n, now))
        self._place()

    def _place(self) -> None:
        """What waits, on the engines, up to the limit: placing stops at the first group that fits nowhere."""
        if not self.waiting:
            return
        fits = len(self.waiting) if self.limit is None else self.limit * self.driver.engines
        batch = list(itertools.islice(self.waiting, fits))
        for _ in range(self.driver.launch(batch, self.limit)):
            self.waiting.popleft()

    def _hear(self, news: RaceNews) -> None:
        for done in news.done:
            if self._closed():  # whatever else completed in the same poll is too late
                return
            self._group_done(done)
        if self.handoff is not None and not self._closed():
            for tokens in news.finished:  # at each one: news of many must not step over the hand-off window
                self.finished[0] += 1
                self.finished[1] += tokens
                self._maybe_hand_off()

    def _maybe_hand_off(self) -> None:
        released = self.handoff.decide(*self.finished, running=self.driver.outstanding, stats=self.driver.stats)
        if not released:
            return
        self.migrated = list(self.driver.retire(released))
        self.handed_off = (self.clock.now(), tuple(released))
        self.handoff.policy.on_release(released)

    def _group_done(self, done: GroupDone) -> None:
        group = self.groups[done.key]
        if group.complete or group.done is not None:  # reported twice (a push that crossed a hand-off)
            return
        done.group.prompt = group.prompt  # a remote engine's group comes without it
        group.done = done.group
        if done.mark is not None:  # kept in mark order, by _keep_marked
            heapq.heappush(self.marked, (done.mark, done.key))
            return
        self._settle(done.key)

    def _keep_marked(self) -> None:
        """Logical: keep reported groups, least mark first, while none an engine still races could
        come before them (and none waits to be placed)."""
        if not self.marked:  # the wall-clock race's rounds: nothing to ask the engines' floors
            return
        floor = self.driver.floor()
        while self.marked and not self._closed() and not self.waiting and (floor is None or self.marked[0][0] < floor):
            self._settle(heapq.heappop(self.marked)[1])

    def _settle(self, key: int) -> None:
        group = self.groups[key]
        group.complete = True
        done = group.done
        if not self.keeps(done):
            self.filtered.append(group.prompt)
            self.filtered_tokens.append(max(done.lengths))
            if (extra := self.replacement()) is not None:
                self._launch(extra)
            return
        group.kept = True
        self.kept.append(done)
        if self.async_reward and self.on_group_done is not None:
            self.on_group_done(done)

    def _closed(self) -> bool:
        """P0 groups are kept: whatever else completes is too late."""
        return len(self.kept) >= self.plan.target_groups

    def _score_after_rollout(self) -> None:
        pending = [(s, self.reward.submit(s, key=f"p{s.prompt.uid}")) for group in self.kept for s in group.samples]
        for _, future in pending:
            future.add_done_callback(lambda _: self.driver.wake())
        for sample, future in pending:
            while not future.done():
                self.driver.wait_for_time()
            score = future.result()
            sample.reward, sample.correct, sample.reward_reason = float(score.reward), score.correct, score.reason
            sample.scored_at = self.clock.now()
        if self.on_group_done is not None:
            for group in self.kept:
                self.on_group_done(group)

    def _result(self, start: float, rollout_end: float, bubble: float) -> RoundResult:
        preemptions, generated = self.driver.counters()
        if self.logical:  # launch order: the order the groups were kept in depends on when news came
            self.kept = [g.done for g in self.groups if g.kept]
        batch_tokens = sum(sum(g.lengths) for g in self.kept)
        deferred = [g.prompt for g in self.groups if not g.complete]
        stats = RoundStats(
            rollout_seconds=rollout_end - start,
            reward_seconds=self.clock.now() - rollout_end,
            bubble_fraction=bubble,
            generated_tokens=generated,
            batch_tokens=batch_tokens,
            wasted_tokens=max(0, generated - batch_tokens),
            preemptions=preemptions,
            launched_prompts=len(self.groups),
            launched_responses=sum(g.n for g in self.groups),
            kept_prompts=len(self.kept),
            filtered_prompts=len(self.filtered),
            deferred_prompts=len(deferred),
            migrated_requests=self.migrated[0],
            migrated_tokens=self.migrated[1],
            handoff_fraction=self.handoff.fired_at if self.handoff and self.handoff.fired_at is not None else 0.0,
        )
        return RoundResult(self.plan.index, self.plan.kind, self.plan.tp, self.kept, self.filtered,
                           self.filtered_tokens, deferred, stats, self._trace(start, rollout_end),
                           completed=[g.done for g in self.groups], ep=self.plan.ep)

    def _trace(self, start: float, rollout_end: float) -> RoundTrace:
        at, released = self.handed_off or (None, ())
        first = sorted(self.driver.reports, key=lambda i: self.driver.retired_at(i) is None)  # held it first
        build = functools.partial(_request_traces, self.groups, [(i, self.driver.reports[i]) for i in first], start)
        return RoundTrace(self.driver.engines, build, rollout_end - start, None if at is None else at - start,
                          released)


def _request_traces(groups: list[_Group], reports: list[tuple[int, RaceReport]], start: float) -> list[RequestTrace]:
    """Every launched request, in launch order, with the engines that held it (from the races' reports,
    in the order they held it) and what became of it."""
    spans: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
    for engine, report in reports:
        for key, held in report.spans.items():
            for r, t0, t1 in held:
                spans.setdefault((key, r), []).append((engine, t0 - start, t1 - start))
    requests = []
    for key, group in enumerate(groups):
        done = {s.response_index: s for s in group.done.samples} if group.done is not None else {}
        for r in range(group.n):
            sample = done.get(r) or Sample(prompt=group.prompt, response_index=r, submitted_at=group.launched_at)
            if not group.complete:
                outcome = Outcome.DEFERRED
            elif r not in done:
                outcome = Outcome.ABORTED
            else:
                outcome = Outcome.TRAINED if group.kept else Outcome.FILTERED
            requests.append(RequestTrace(sample, outcome, tuple(spans.get((key, r), ()))))
    return requests


@dataclass
class _Assembly:
    """An open group: how many parts it was placed in, those done so far."""
    expected: int
    parts: list[tuple[int, SampleGroup]] = field(default_factory=list)  # (part key, its samples)


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
        # the deterministic race: each engine's floor as of the parts it had been sent when it told
        self._sent = [0] * fleet.size
        self._floors: list[tuple[int, Mark | None]] = [(0, None)] * fleet.size
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
        placed, heap = 0, self._by_load()
        for g in groups:
            if g.key in self._open:
                raise ValueError(f"group {g.key} is already open")
            parts = self._parts(g)
            if not self._place(parts, limit, heap):
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
            self._floors[i] = (n.launched, n.floor)
            n.done = [done for part in n.done if (done := self._complete(i, part)) is not None]
        return news

    def floor(self) -> Mark | None:
        """The least mark a group still raced could get, over the engines racing one (None: none is).
        An engine that has not told since it was last sent parts has a floor below every mark."""
        floors = []
        for i in set(self._placed.values()):
            told, floor = self._floors[i]
            if told < self._sent[i]:
                return (-1, -1)
            if floor is not None:
                floors.append(floor)
        return min(floors, default=None)

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
        self._place(handed, None, self._by_load())
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

    def _by_load(self) -> list[tuple[int, int, int]]:
        """The engines that stay as a heap of (outstanding requests, prompt tokens, index), for
        ``_place``; one per launch, as building it costs as much as placing a group."""
        heap = [(load, toks, i) for i, (load, toks) in enumerate(zip(self._load, self._tokens))
                if i not in self._retired]
        heapq.heapify(heap)
        return heap

    def _place(self, parts: list[GroupLaunch], limit: int | None, heap: list[tuple[int, int, int]]) -> bool:
        """Put each part on the least loaded engine of ``heap`` (all of them, or none where one would
        go past ``limit``: the caller stops placing then, and drops the heap); their calls wait for
        ``_send``."""
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
        for i, parts in outbox.items():
            self._sent[i] += len(parts)
        self.fleet.call((i, Launch(parts)) for i, parts in outbox.items())

    def _complete(self, engine: int, done: GroupDone) -> GroupDone | None:
        """A part is done: its group, when that was its last open part (None: not yet, or reported before)."""
        if self._placed.pop(done.key, None) is None:
            return None
        self._tokens[engine] -= self._part_tokens.pop(done.key)
        key = self._part_group[done.key]
        group = self._open[key]
        group.parts.append((done.key, done.group))
        if len(group.parts) < group.expected:
            return None
        del self._open[key]
        parts = [part for _, part in sorted(group.parts, key=lambda p: p[0])]  # part keys follow response order
        return GroupDone(key, parts[0] if len(parts) == 1 else SampleGroup.joined(parts), done.mark)

    def _by_group(self, report: RaceReport) -> RaceReport:
        """``report`` with its spans by group (a race keys them by its parts)."""
        spans: dict[int, list] = defaultdict(list)
        for part, held in report.spans.items():
            spans[self._part_group[part]] += held
        report.spans = dict(spans)
        return report
