"""Dispatch over a round's engines: load balancing, driving, slot accounting.

``RolloutEngine.poll`` is the only call that advances an engine. On a real
clock the driver polls every engine without blocking and, after a sweep that
returned nothing, lets one engine block briefly (round robin) so that a
waiting scheduler does not spin. Remote engines whose servers push their
completions to a shared bell (``Announcing``) are not polled: the driver takes
what reached the bell, and with no local engine waits on it. Its cost then
grows with the completions, not with the engines or the length of the round;
what else it waits for (scores) ``wake``s it, so it never wakes on a timer. On a ``VirtualClock`` nothing moves by
itself: the driver asks every ``EventSource`` (simulated engines, a reward
model with latency) for its next event, advances the clock to the earliest,
then polls every engine, which simulates itself up to the new time.
"""
from __future__ import annotations

import functools
import heapq
import time
from collections import defaultdict
from typing import Iterable, Sequence

from rollpacker.rollout.engine import Completion, EngineStats, GenerationRequest, RolloutEngine
from rollpacker.scheduler.clock import Clock, VirtualClock
from rollpacker.scheduler.protocols import Announcing, EventSource, Pipelined

# with a bell, every engine is polled anyway after this long without news: completions its server
# could not push (the bell's socket full) cannot stall a round
_FULL_SWEEP_AFTER_S = 5.0


class StalledError(RuntimeError):
    """Requests are outstanding but nothing can make progress (virtual clock)."""


class EngineDriver:
    def __init__(self, engines: Sequence[RolloutEngine], clock: Clock, *, idle_poll_s: float = 0.005,
                 event_sources: Sequence[object] = ()) -> None:
        if not engines:
            raise ValueError("a round needs at least one rollout engine")
        self._engines = list(engines)
        self._clock = clock
        self._idle_poll_s = idle_poll_s
        self._virtual = isinstance(clock, VirtualClock)
        if self._virtual:
            not_simulated = [i for i, e in enumerate(engines) if not isinstance(e, EventSource)]
            if not_simulated:
                raise TypeError(f"engines {not_simulated} do not implement next_event_time(); "
                                "a VirtualClock needs simulated engines")
        self._event_sources = [*engines, *(s for s in event_sources if isinstance(s, EventSource))]
        bells = {id(e.bell): e.bell for e in engines if isinstance(e, Announcing) and e.bell is not None}
        if len(bells) > 1:
            raise ValueError("a round's remote engines must share one bell")
        self._bell = next(iter(bells.values()), None)
        if self._bell is not None:  # what the bell still gets from an earlier driver's round is stale
            self._bell.new_round()
        self._local = [i for i, e in enumerate(engines) if not (isinstance(e, Announcing) and e.bell is not None)]
        self._pipelined = {i for i, e in enumerate(engines) if isinstance(e, Pipelined)}
        self._last_news = time.monotonic()
        self._owner: dict[str, int] = {}  # outstanding request id -> engine index
        self._load = [0] * len(engines)  # outstanding requests per engine
        self._prompt_tokens = [0] * len(engines)
        self._tokens_of: dict[str, int] = {}
        self._next_blocking = 0
        self._retired: dict[int, tuple[float, EngineStats]] = {}  # engine -> (when, its final stats)
        # request id -> [engine, submitted, released (None while outstanding)] per engine that held it:
        # the rollout Gantt of the step (a migrated request has two)
        self.placements: dict[str, list[list]] = defaultdict(list)
        # slot accounting
        self._start = clock.now()
        self._last = self._start
        self._busy_slot_seconds = 0.0
        self._peak = [0] * len(engines)
        stats = self._each((i, "stats") for i in range(len(engines)))
        self._preemptions0 = [s.preemptions for s in stats]
        self._tokens0 = [s.tokens_generated for s in stats]

    @property
    def engines(self) -> int:
        return len(self._engines)

    @property
    def outstanding(self) -> int:
        return len(self._owner)

    def outstanding_ids(self) -> list[str]:
        return list(self._owner)

    def submit(self, requests: Iterable[GenerationRequest]) -> None:
        """Send each request to the engine with the fewest outstanding requests
        (then fewest outstanding prompt tokens); one prompt's responses spread."""
        self._account()
        heap = [(load, toks, i) for i, (load, toks) in enumerate(zip(self._load, self._prompt_tokens))
                if i not in self._retired]
        heapq.heapify(heap)
        batches: dict[int, list[GenerationRequest]] = defaultdict(list)
        for req in requests:
            if req.request_id in self._owner:
                raise ValueError(f"request {req.request_id} is already outstanding")
            load, toks, i = heapq.heappop(heap)
            batches[i].append(req)
            self._owner[req.request_id] = i
            self.placements[req.request_id].append([i, self._last, None])
            self._tokens_of[req.request_id] = len(req.input_ids) + len(req.resume_ids)
            heapq.heappush(heap, (load + 1, toks + self._tokens_of[req.request_id], i))
        self._each((i, "submit", batch) for i, batch in batches.items())
        for i, batch in batches.items():
            self._load[i] += len(batch)
            self._prompt_tokens[i] += sum(self._tokens_of[r.request_id] for r in batch)
            self._peak[i] = max(self._peak[i], self._load[i])

    def abort(self, request_ids: Iterable[str]) -> None:
        self._account()
        by_engine: dict[int, list[str]] = defaultdict(list)
        for rid in request_ids:
            if rid in self._owner:
                by_engine[self._release(rid)].append(rid)
        self._each((i, "abort", ids) for i, ids in by_engine.items())

    def retire(self, indices: Sequence[int]) -> list[Completion]:
        """Take engines out of the round: every request outstanding on them is evicted and
        handed back (finished ones as they are, the rest to be resubmitted elsewhere);
        they get no more work and are not called again."""
        self._account()
        handed: list[Completion] = []
        for i in indices:
            ids = [rid for rid, owner in self._owner.items() if owner == i]
            for rid in ids:
                self._release(rid)
            handed += self._engines[i].evict(ids) if ids else []
            self._retired[i] = (self._clock.now(), self._engines[i].stats())
        return handed

    def active_stats(self) -> list[EngineStats]:
        """Each engine's stats; a retired engine reports nothing in use and no capacity."""
        live = [i for i in range(len(self._engines)) if i not in self._retired]
        stats = dict(zip(live, self._each((i, "stats") for i in live)))
        return [stats.get(i, EngineStats()) for i in range(len(self._engines))]

    def poll(self) -> list[Completion]:
        """Advance the engines; return the completions of outstanding requests."""
        active = [e for i, e in enumerate(self._engines) if i not in self._retired] if self._bell is None else []
        if self._virtual:
            self._advance_virtual_clock()
            raw = [c for e in active for c in e.poll(0.0)]
        elif self._bell is not None:
            raw = self._poll_announced()
        else:
            raw = [c for e in active for c in e.poll(0.0)]
            if not raw and self._owner:
                engine = active[self._next_blocking % len(active)]
                self._next_blocking += 1
                raw = engine.poll(self._idle_poll_s)
        self._account()
        done = []
        for c in raw:
            # a completion racing its own abort is dropped, as is one pushed by an engine whose
            # requests ``retire`` handed back (the evict returned it too)
            if c.request_id in self._owner:
                self._release(c.request_id)
                done.append(c)
        return done

    def _poll_announced(self) -> list[Completion]:
        """Local engines and what reached the bell; with nothing and no local engine, sleep until a
        server pushes, ``wake`` is called or the next full sweep is due."""
        local = [i for i in self._local if i not in self._retired]
        if time.monotonic() - self._last_news > _FULL_SWEEP_AFTER_S:
            polled = [i for i in range(len(self._engines)) if i not in self._retired]
            self._last_news = time.monotonic()
        else:
            polled = local
        raw = [c for i in polled for c in self._engines[i].poll(0.0)] + self._bell.collect()
        if not raw and self._owner:
            if local:
                engine = self._engines[local[self._next_blocking % len(local)]]
                self._next_blocking += 1
                raw = engine.poll(self._idle_poll_s)
            elif not self._bell.woken:  # woken: the caller has something to look at first
                raw = self._bell.collect(max(0.0, self._last_news + _FULL_SWEEP_AFTER_S - time.monotonic()))
        if raw or not self._owner:
            self._last_news = time.monotonic()
        return raw

    def wake(self) -> None:
        """End a wait in ``poll`` or ``wait_for_time`` early (from any thread): something the caller
        waits for besides the engines (a score) has come. Without a bell the waits are short anyway."""
        if self._bell is not None:
            self._bell.wake()

    def wait_for_time(self) -> None:
        """Wait for something other than the engines (reward scores), with no request outstanding:
        on a virtual clock, move to the next simulated event; with a bell and no local engine, until
        ``wake`` (what reaches the bell meanwhile is stale: nothing is outstanding); else sleep briefly."""
        if self._owner:
            raise RuntimeError("wait_for_time with requests outstanding: poll for them instead")
        if self._virtual:
            self._advance_virtual_clock()
        elif self._bell is not None and not self._local:
            self._bell.collect(_FULL_SWEEP_AFTER_S)
        else:
            time.sleep(self._idle_poll_s)

    def bubble_fraction(self) -> float:
        """A retired engine's slots count only until it left the round (its ranks then train)."""
        self._account()
        slot_seconds = sum(peak * ((self._retired[i][0] if i in self._retired else self._last) - self._start)
                           for i, peak in enumerate(self._peak))
        return 0.0 if slot_seconds <= 0 else max(0.0, 1.0 - self._busy_slot_seconds / slot_seconds)

    def counters(self) -> tuple[int, int]:
        """(preemptions, generated tokens) since this driver was created."""
        live = [i for i in range(len(self._engines)) if i not in self._retired]
        stats = [s for _, s in self._retired.values()] + self._each((i, "stats") for i in live)
        pre = sum(s.preemptions for s in stats) - sum(self._preemptions0)
        toks = sum(s.tokens_generated for s in stats) - sum(self._tokens0)
        return pre, toks

    def _each(self, calls: Iterable[tuple]) -> list:
        """``(engine index, method, *args)`` called on each engine, their results in order. Every
        pipelined engine gets its call before any reply is awaited (local engines are called then);
        each reply is awaited even when one is an error (a channel left without its reply could
        not be used again), then the first error is raised."""
        pending = [self._engines[i].begin(method, *args) if i in self._pipelined
                   else functools.partial(getattr(self._engines[i], method), *args) for i, method, *args in calls]
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
        retired = {id(self._engines[i]) for i in self._retired}
        times = [t for t in (s.next_event_time() for s in self._event_sources if id(s) not in retired)
                 if t is not None]
        if not times:
            raise StalledError(f"{self.outstanding} requests outstanding but no simulated event is scheduled")
        now = self._clock.now()
        self._clock.advance_to(max(now, min(times)))  # type: ignore[attr-defined]

    def _release(self, rid: str) -> int:
        i = self._owner.pop(rid)
        self.placements[rid][-1][2] = self._clock.now()
        self._load[i] -= 1
        self._prompt_tokens[i] -= self._tokens_of.pop(rid)
        return i

    def _account(self) -> None:
        now = self._clock.now()
        self._busy_slot_seconds += sum(self._load) * (now - self._last)
        self._last = now
