"""What the engines that decode in this process (reference, trainer-matched) share: their requests' queues."""
from __future__ import annotations

import abc
import random
import time
from dataclasses import dataclass, field
from collections import deque
from typing import Sequence

import torch

from rollpacker.rollout.engine import (FINISH_EVICTED, MEMORY_TAGS, Completion, GenerationRequest, RequestError,
                                       RolloutEngine)
from rollpacker.rollout.sampling import draw_uniforms


@dataclass
class QueuedRequest:
    req: GenerationRequest
    uniforms: torch.Tensor  # one per token it may generate (empty when greedy)
    submitted_at: float
    output_ids: list[int] = field(default_factory=list)  # kept across a preemption or a migration
    logprobs: list[float] = field(default_factory=list)

    @classmethod
    def queue(cls, r: GenerationRequest, seeds: random.Random) -> "QueuedRequest":
        """``r`` as submitted now; a resumed request continues its own sampling stream."""
        p = r.params
        seed = p.seed if p.seed is not None else seeds.getrandbits(63)
        uniforms = draw_uniforms(seed, p.max_new_tokens) if p.temperature > 0 else torch.zeros(0)
        return cls(r, uniforms, time.monotonic(), list(r.resume_ids), list(r.resume_logprobs))


class InProcessEngine(RolloutEngine):
    """Submission, polling and the request queues; subclasses decode (``_step``) and say which requests
    they cannot serve (``_problem``) and when they cannot serve at all (``_check_serving``)."""

    engine_id: int

    def _init_queues(self, seed: int, engine_id: int) -> None:
        self._waiting: deque[QueuedRequest] = deque()
        self._running: list[QueuedRequest] = []
        self._done: list[Completion] = []
        self._seeds = random.Random(seed * 1_000_003 + engine_id)  # for requests submitted without a seed

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue every request ``_problem`` finds nothing wrong with; then refuse the others, by name, in
        one ``RequestError``."""
        self._require_leader()
        active = set(self.active_request_ids())
        errors, refused = [], []
        for r in requests:
            found = self._problem(r, active)
            if found:
                errors.append(f"request {r.request_id!r}: {found}")
                refused.append(r.request_id)
                continue
            active.add(r.request_id)
            self._waiting.append(QueuedRequest.queue(r, self._seeds))
        if errors:
            raise RequestError("; ".join(errors), refused)

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """Run steps until something finished, ``timeout`` passed (0: one step) or nothing is left."""
        self._require_leader()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._running or self._waiting:
            self._check_serving()
            self._step()
            if self._done or (deadline is not None and time.monotonic() >= deadline):
                break
        done, self._done = self._done, []
        return done

    def active_request_ids(self) -> list[str]:
        return ([r.req.request_id for r in self._running] + [r.req.request_id for r in self._waiting]
                + [c.request_id for c in self._done])

    def _evicted(self, ids: set[str]) -> list[Completion]:
        """``evict``'s answer: finished ones as they are, the others with their tokens so far."""
        now = time.monotonic()
        return [c for c in self._done if c.request_id in ids] + [
            Completion(r.req.request_id, r.output_ids, r.logprobs, FINISH_EVICTED, r.submitted_at, now, self.engine_id)
            for r in [*self._running, *self._waiting] if r.req.request_id in ids]

    def _require_leader(self) -> None:
        """Request-plane calls are the leader's (engines of one rank are their own leader)."""

    @abc.abstractmethod
    def _problem(self, r: GenerationRequest, active: set[str]) -> str | None:
        """Why ``r`` cannot be served (None: it can); ``active``: the ids in flight."""

    @abc.abstractmethod
    def _check_serving(self) -> None:
        """Raise if the engine cannot decode now (memory released, weights incomplete)."""

    @abc.abstractmethod
    def _step(self) -> None:
        """Admit, decode one token for every running request, retire the finished."""


def check_tags(tags: Sequence[str]) -> None:
    unknown = set(tags) - set(MEMORY_TAGS)
    if unknown:
        raise ValueError(f"unknown memory tags {sorted(unknown)}; valid: {MEMORY_TAGS}")
