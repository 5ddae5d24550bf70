"""Length replay: every response as long as a length trace says, whatever the model writes.

For measuring the scheduler on real engines at a chosen length distribution (a published trace's
shape) with a model that would write another: ``LengthReplay`` wraps any ``RolloutEngine`` and
submits each request with its stop tokens removed and ``max_new_tokens`` set to its length from the
trace, capped by the request's own limit (sglang is then told to ignore EOS:
``sglang_api.sampling_params``). A request's length is a draw from its prompt's list in the trace,
fixed by the request's sampling seed and id, so a request migrated to another engine keeps its
length, a regenerated prompt draws anew, and every rank computes the same length for a request
without sharing state. The rewards of such responses mean nothing: replay measures time.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable, Sequence

from rollpacker.rollout.config import ReplayConfig
from rollpacker.rollout.engine import MEMORY_TAGS, Completion, EngineStats, GenerationRequest, RolloutEngine

PARAMETRIC_PROMPTS = 4096  # prompts drawn by the parametric model; prompt uid u takes row u mod this


class ReplayLengths:
    """A request's replayed length: from ``cfg.trace``, or the parametric long-tail model."""

    def __init__(self, cfg: ReplayConfig, limit: int) -> None:
        from rollpacker.sim.traces import load_trace, longtail_trace

        cfg.validate()
        self.seed = cfg.seed
        self.trace = (load_trace(cfg.trace) if cfg.trace else
                      longtail_trace(PARAMETRIC_PROMPTS, samples=16, median=cfg.median, limit=limit,
                                     sigma_prompt=cfg.sigma_prompt, sigma_response=cfg.sigma_response, seed=cfg.seed))

    def __call__(self, request: GenerationRequest) -> int:
        from rollpacker.sim.traces import parse_request_id

        uid, epoch, _ = parse_request_id(request.request_id)
        lengths = self.trace[uid % len(self.trace)].lengths_in(epoch)
        key = f"{self.seed}/{request.request_id}/{request.params.seed}".encode()
        return lengths[int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % len(lengths)]


class LengthReplay(RolloutEngine):
    """``engine`` with every submitted request's length set by ``lengths`` (see the module)."""

    def __init__(self, engine: RolloutEngine, lengths: ReplayLengths) -> None:
        self.engine, self.lengths = engine, lengths
        self.engine_id = engine.engine_id

    def _replayed(self, r: GenerationRequest) -> GenerationRequest:
        params = dataclasses.replace(r.params, stop_token_ids=(),
                                     max_new_tokens=min(r.params.max_new_tokens, self.lengths(r)))
        return dataclasses.replace(r, params=params)

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self.engine.submit([self._replayed(r) for r in requests])

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        return self.engine.poll(timeout)

    def abort(self, request_ids: Iterable[str]) -> None:
        self.engine.abort(request_ids)

    def evict(self, request_ids: Iterable[str]) -> list[Completion]:
        return self.engine.evict(request_ids)

    def ready_fd(self) -> int | None:
        return self.engine.ready_fd()

    def active_request_ids(self) -> list[str]:
        return self.engine.active_request_ids()

    def progress(self, request_ids: Sequence[str]) -> list[int]:
        return self.engine.progress(request_ids)

    def update_weights(self, named_tensors) -> None:
        self.engine.update_weights(named_tensors)

    def max_weight_diff(self, named_tensors) -> float:
        return self.engine.max_weight_diff(named_tensors)

    def serve_follower(self) -> str:
        return self.engine.serve_follower()

    def stop_followers(self) -> None:
        self.engine.stop_followers()

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self.engine.release_memory(tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self.engine.resume_memory(tags)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __getattr__(self, name: str) -> Any:  # what a backend adds to the interface (kv_capacity, ...)
        if name == "engine":  # not set yet: no recursion through the lookup below
            raise AttributeError(name)
        return getattr(self.engine, name)
