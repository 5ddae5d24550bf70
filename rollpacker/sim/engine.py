"""A modeled continuous-batching engine on a virtual clock.

It behaves like the real engines in everything tail batching observes:
continuous batching (requests join the running batch at step boundaries),
per-request completion, abort, and a KV-cache budget. When the next decode
step would overflow the budget, the most recently admitted request is
preempted (its KV freed, its generated tokens kept) and put back at the head
of the waiting queue; re-admission recomputes its context as a prefill, as
SGLang and vLLM do. Waiting requests are admitted FIFO while the KV in use
stays below ``admit_fraction`` of the budget.

Time is event-driven: between events (a finish, an overflow) the running
batch is fixed, so the time of k decode steps has a closed form
(``DecodeCost.decode_seconds``) and per-request progress is kept lazily as
``admit_step``; simulating a round costs O(events log n), not O(tokens).
"""
from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from rollpacker.rollout.engine import (FINISH_EVICTED, FINISH_LENGTH, FINISH_STOP, MEMORY_TAGS, Completion, EngineStats,
                                       GenerationRequest, RequestError, RolloutEngine)
from rollpacker.scheduler.clock import VirtualClock
from rollpacker.sim.perf import DecodeCost

if TYPE_CHECKING:
    import torch


@dataclass
class _Request:
    rid: str
    prompt_len: int
    target: int  # tokens this response will have when it finishes
    finish_reason: str
    submitted_at: float
    generated: int = 0  # tokens generated before the current admission
    admit_step: int = 0
    seq: int = 0  # admission number; tells live heap entries from stale ones

    def context(self, step: int) -> int:
        return self.prompt_len + self.generated + (step - self.admit_step)


class SimEngine(RolloutEngine):
    def __init__(self, perf: DecodeCost, clock: VirtualClock, response_length: Callable[[GenerationRequest], int], *,
                 engine_id: int = 0, max_running: int = 1024, admit_fraction: float = 0.9,
                 kv_capacity_tokens: int | None = None) -> None:
        self.perf, self.clock, self.response_length = perf, clock, response_length
        self.engine_id = engine_id
        self.max_running = max_running
        self.capacity = kv_capacity_tokens or perf.kv_capacity_tokens
        self.admit_limit = int(admit_fraction * self.capacity)
        self.t = clock.now()  # engine time: the last decode-step boundary
        self.step = 0
        self.running: dict[str, _Request] = {}  # admission order: the last one is preempted first
        self.waiting: collections.deque[_Request] = collections.deque()
        self.context_total = 0  # KV tokens held by the running batch
        self.prefill_pending = 0  # tokens to prefill in the next step
        self._finish_heap: list[tuple[int, int, str]] = []  # (finish step, seq, rid)
        self._seq = 0
        self._done: list[Completion] = []
        self._stats = EngineStats(kv_tokens_capacity=self.capacity)

    # -- RolloutEngine ----------------------------------------------------
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self._advance(self.clock.now())
        active = set(self.active_request_ids())
        for req in requests:
            req.params.validate()
            if req.request_id in active:
                raise RequestError(f"request {req.request_id} is already active on engine {self.engine_id}")
            if len(req.input_ids) + req.params.max_new_tokens > self.capacity:
                raise RequestError(f"request {req.request_id}: prompt {len(req.input_ids)} + max_new_tokens "
                                   f"{req.params.max_new_tokens} exceeds the KV capacity {self.capacity}")
            length = self.response_length(req)
            target = min(length, req.params.max_new_tokens)
            reason = FINISH_LENGTH if length >= req.params.max_new_tokens else FINISH_STOP
            self.waiting.append(_Request(req.request_id, len(req.input_ids), target, reason, self.clock.now(),
                                         generated=min(len(req.resume_ids), target)))
            active.add(req.request_id)
        self._wake()

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        self._advance(self.clock.now())
        done, self._done = self._done, []
        return done

    def abort(self, request_ids: Iterable[str]) -> None:
        self.evict(request_ids)  # the same, with nothing handed back

    def evict(self, request_ids: Iterable[str]) -> list[Completion]:
        self._advance(self.clock.now())
        ids = set(request_ids)
        handed = [c for c in self._done if c.request_id in ids]
        held = []
        for rid in ids & self.running.keys():
            req = self.running.pop(rid)
            self._evict(req)
            req.generated += self.step - req.admit_step
            held.append(req)
        held += [r for r in self.waiting if r.rid in ids]
        self.waiting = collections.deque(r for r in self.waiting if r.rid not in ids)
        self._done = [c for c in self._done if c.request_id not in ids]
        self._wake()
        return handed + [Completion(r.rid, [0] * r.generated, [0.0] * r.generated, FINISH_EVICTED,
                                    submitted_at=r.submitted_at, finished_at=self.t, engine_id=self.engine_id)
                         for r in held]

    def active_request_ids(self) -> list[str]:
        return [*self.running, *(r.rid for r in self.waiting), *(c.request_id for c in self._done)]

    def progress(self, request_ids: Sequence[str]) -> list[int]:
        self._advance(self.clock.now())
        generated = {c.request_id: len(c.output_ids) - 1 for c in self._done}
        generated.update((r.rid, r.generated) for r in self.waiting)
        generated.update((rid, r.generated + self.step - r.admit_step) for rid, r in self.running.items())
        return [generated[i] for i in request_ids]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _ in named_tensors:  # a modeled engine holds no weights; consume the stream as a real one would
            pass

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        if self.running or self.waiting:
            raise RuntimeError(f"engine {self.engine_id}: release_memory needs an idle engine")

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        pass

    def stats(self) -> EngineStats:
        self._stats.running = len(self.running)
        self._stats.waiting = len(self.waiting)
        self._stats.kv_tokens_used = self.context_total
        return self._stats

    # -- EventSource ------------------------------------------------------
    def next_event_time(self) -> float | None:
        if not self.running:
            return max(self.t, self.clock.now()) if self.waiting else None
        steps = min(self._steps_to_finish(), self._steps_to_overflow())
        return self.t + self._seconds(steps)

    # -- model ------------------------------------------------------------
    def _wake(self) -> None:
        if not self.running:  # an idle engine starts the new work now, not at its last step boundary
            self.t = max(self.t, self.clock.now())

    def _advance(self, until: float) -> None:
        while True:
            self._admit()
            if not self.running:
                self.t = max(self.t, until)
                return
            overflow = self._steps_to_overflow()
            if overflow == 0:
                self._preempt()
                continue
            steps = min(self._steps_to_finish(), overflow)
            seconds = self._seconds(steps)
            if self.t + seconds > until:
                budget = until - self.t - self.perf.prefill_seconds(self.prefill_pending)
                partial = min(steps - 1, self.perf.steps_within(budget, len(self.running), self.context_total))
                if partial > 0:
                    self._run_steps(partial, self._seconds(partial))
                return
            self._run_steps(steps, seconds)
            self._finish_due()

    def _seconds(self, steps: int) -> float:
        return (self.perf.prefill_seconds(self.prefill_pending)
                + self.perf.decode_seconds(steps, len(self.running), self.context_total))

    def _steps_to_finish(self) -> int:
        heap = self._finish_heap
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] - self.step

    def _steps_to_overflow(self) -> int:
        return (self.capacity - self.context_total) // len(self.running)

    def _live(self, entry: tuple[int, int, str]) -> bool:
        req = self.running.get(entry[2])
        return req is not None and req.seq == entry[1]

    def _run_steps(self, steps: int, seconds: float) -> None:
        batch = len(self.running)
        self.step += steps
        self.context_total += steps * batch
        self.t += seconds
        self.prefill_pending = 0
        self._stats.tokens_generated += steps * batch

    def _finish_due(self) -> None:
        heap = self._finish_heap
        while heap and (heap[0][0] <= self.step or not self._live(heap[0])):
            entry = heapq.heappop(heap)
            if not self._live(entry):
                continue
            req = self.running.pop(entry[2])
            self._evict(req)
            self._done.append(Completion(req.rid, [0] * req.target, [0.0] * req.target, req.finish_reason,
                                         submitted_at=req.submitted_at, finished_at=self.t,
                                         engine_id=self.engine_id))

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = req.prompt_len + req.generated
            if self.running and self.context_total + need > self.admit_limit:
                return
            self.waiting.popleft()
            self._seq += 1
            req.admit_step, req.seq = self.step, self._seq
            self.running[req.rid] = req
            self.context_total += need
            self.prefill_pending += need
            heapq.heappush(self._finish_heap, (self.step + req.target - req.generated, req.seq, req.rid))

    def _preempt(self) -> None:
        victim = self.running.pop(next(reversed(self.running)))
        self._evict(victim)
        victim.generated += self.step - victim.admit_step
        self.waiting.appendleft(victim)
        self._stats.preemptions += 1

    def _evict(self, req: _Request) -> None:
        self.context_total -= req.context(self.step)
