"""The trainer-matched engine (``rollout.match_trainer``): samples from exactly the trained policy.

Every decode step runs the trainer's Megatron forward (:class:`megatron_ext.matched.TrainerForward`)
over each running request's whole sequence, right-padded to the run's fixed window, and samples
the next token from that row's logits; the log-prob it reports is the trainer's own function of
the same row. The CPU trainer, padding every row to the same window, therefore computes bit-equal
log-probs: the engine-trainer gap (``mismatch/*``) reads exactly 0 and every importance weight is
exactly 1.

What it gives up is the KV cache: a step recomputes the window for every running request, so
decoding costs ``window`` tokens of forward per generated token. It is a mode for experiments that
must exclude the gap (and for checking that the gap the other engines show is theirs), on one rank
per engine (rollout TP 1) with the CPU trainer at TP 1. Scheduling, sampling and migration behave
as in the reference engine: FIFO admission up to ``max_running_requests``, per-request seeded
uniforms (the same draws the reference engine makes), eviction with the tokens so far.
"""
from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Iterable, Sequence

import torch

from megatron_ext.matched import TrainerForward
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import (FINISH_LENGTH, FINISH_STOP, MEMORY_TAGS, Completion, EngineStats,
                                       GenerationRequest, request_problem)
from rollpacker.rollout.inprocess import InProcessEngine, check_tags
from rollpacker.rollout.sampling import sample


class MatchedEngine(InProcessEngine):
    """One rank's engine computing with the trainer's model at a fixed ``window`` of tokens."""

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, window: int, engine_id: int = 0,
                 device: str | torch.device = "cpu"):
        cfg.validate()
        self.cfg, self.engine_id, self.window = cfg, engine_id, window
        self.forward = TrainerForward(model_dir, window, device)
        self.vocab_size = self.forward.spec.vocab_size
        self._init_queues(cfg.seed, engine_id)
        self._missing_weights: set[str] = set()
        self._released: set[str] = set()
        self._stats = EngineStats(kv_tokens_capacity=cfg.max_running_requests * window)

    # ---- request plane -------------------------------------------------------------------------
    def abort(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        self._waiting = deque(r for r in self._waiting if r.req.request_id not in ids)
        self._running = [r for r in self._running if r.req.request_id not in ids]
        self._done = [c for c in self._done if c.request_id not in ids]

    def evict(self, request_ids: Iterable[str]) -> list[Completion]:
        ids = set(request_ids)
        answer = self._evicted(ids)
        self.abort(ids)
        return answer

    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(running=len(self._running), waiting=len(self._waiting),
                           kv_tokens_used=len(self._running) * self.window, kv_tokens_capacity=s.kv_tokens_capacity,
                           tokens_generated=s.tokens_generated, extra={"tp": 1, "window": self.window})

    # ---- control plane -------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._released:
            raise RuntimeError(f"engine {self.engine_id}: weights are released; resume_memory(['weights']) first")
        self._missing_weights -= self.forward.load(named_tensors)

    def max_weight_diff(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        return self.forward.max_diff(named_tensors)

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        if self._running or self._waiting:
            raise RuntimeError(f"engine {self.engine_id}: release_memory needs an idle engine "
                               f"({len(self._running)} running, {len(self._waiting)} waiting)")
        check_tags(tags)
        if "weights" in tags and "weights" not in self._released:
            self.forward.release()
        self._released |= set(tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """After ``weights`` the engine serves only once ``update_weights`` refilled them."""
        check_tags(tags)
        if "weights" in tags and "weights" in self._released:
            self.forward.allocate()
            self._missing_weights = self.forward.loader.names
        self._released -= set(tags)

    def shutdown(self) -> None:
        self._waiting.clear()
        self._running, self._done = [], []
        self.release_memory(MEMORY_TAGS)

    def _check_serving(self) -> None:
        if self._missing_weights or self._released:
            raise RuntimeError(f"engine {self.engine_id}: memory released or weights incomplete; resume_memory "
                               f"and update_weights first ({len(self._missing_weights)} weights missing)")

    def _problem(self, r: GenerationRequest, active: set[str]) -> str | None:
        problem = request_problem(r, active, self.vocab_size)
        if not problem and len(r.input_ids) + r.params.max_new_tokens > self.window:
            problem = (f"prompt ({len(r.input_ids)}) + max_new_tokens ({r.params.max_new_tokens}) exceeds "
                       f"the trainer-matched window of {self.window} tokens")
        return problem

    # ---- decoding ------------------------------------------------------------------------------
    def _step(self) -> None:
        while self._waiting and len(self._running) < self.cfg.max_running_requests:
            self._running.append(self._waiting.popleft())
        rows = [list(r.req.input_ids) + r.output_ids for r in self._running]
        logits = self.forward.logits(rows)
        last = logits[torch.arange(len(rows)), torch.tensor([len(t) - 1 for t in rows])]
        params = [r.req.params for r in self._running]
        uniforms = torch.tensor([float(r.uniforms[len(r.output_ids)]) if r.uniforms.numel() else 0.0
                                 for r in self._running])
        tokens, _ = sample(last[:, :self.vocab_size],
                           torch.tensor([p.temperature for p in params], dtype=torch.float32),
                           torch.tensor([p.top_p for p in params], dtype=torch.float32),
                           torch.tensor([p.top_k for p in params]), uniforms)
        logprobs = self.forward.logprobs(last, tokens)  # the trainer's log-prob of the same row
        now, running = time.monotonic(), []
        for r, token, lp in zip(self._running, tokens.tolist(), logprobs.tolist()):
            r.output_ids.append(token)
            r.logprobs.append(lp)
            stopped = token in r.req.params.stop_token_ids
            if stopped or len(r.output_ids) >= r.req.params.max_new_tokens:
                self._done.append(Completion(r.req.request_id, r.output_ids, r.logprobs,
                                             FINISH_STOP if stopped else FINISH_LENGTH, r.submitted_at, now,
                                             self.engine_id))
            else:
                running.append(r)
        self._stats.tokens_generated += len(rows)
        self._running = running

