"""The stream trainer: one optimizer step assembled from prompt groups as they finish.

During a long round, finished prompt groups (all their responses generated
and scored) are handed to :meth:`StreamTrainer.consume` on the ranks that
already train; each runs forward/backward at once and gradients only
accumulate locally — no optimizer step, no data-parallel traffic. When the
rollout ends, :meth:`StreamTrainer.finish` receives the groups nobody has
consumed yet (the same list on every rank), spreads their samples over all
data-parallel replicas by token count, then sums gradients over the replicas,
divides by the step's global token (or sequence) count, of the tokens the loss
kept (a mismatch correction may reject some), and takes exactly one optimizer
step.

Because every micro-batch contributes an unnormalised sum (see grpo.py), the
update does not depend on which rank consumed which sample, in which order
or in how many calls: a non-streamed step is ``begin(); finish(all_groups)``.
"""
from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from rollpacker.sample import Prompt, Sample
from rollpacker.trainer import mismatch
from rollpacker.trainer.backend import Backend, logprobs_only, micro_batch_loss
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.grpo import LossSums, denominator, group_advantages, step_metrics
from rollpacker.trainer.packing import MicroBatch, balance, plan_micro_batches, sequence_length


def with_advantages(group: Sequence[Sample], cfg: TrainerConfig) -> list[Sample]:
    """Copies of one prompt group's samples with their group-normalised advantages."""
    if not group:
        raise ValueError("a prompt group must hold at least one sample")
    uid = (group[0].prompt.uid, group[0].prompt.epoch)
    for s in group:
        if (s.prompt.uid, s.prompt.epoch) != uid:
            raise ValueError(f"prompt group of prompt {uid[0]} (epoch {uid[1]}) also holds sample {s.request_id}")
        if s.reward is None:
            raise ValueError(f"sample {s.request_id} has no reward; score it before training")
    adv = group_advantages(torch.tensor([s.reward for s in group], dtype=torch.float64),
                           std_normalize=cfg.std_normalize, eps=cfg.adv_eps)
    return [s.replace(advantage=float(a)) for s, a in zip(group, adv)]


@dataclass
class StreamReport:
    """What streaming achieved in one step (global over data-parallel replicas)."""

    started_at: float | None  # wall-clock time the first streamed group began training; None if none did
    rollout_ended_at: float | None  # wall-clock time the rollout ended (on the rank that ran it)
    groups_before_rollout_end: int
    groups_total: int
    tokens_before_rollout_end: int  # compute tokens (prompt + response) trained before rollout ended
    tokens_total: int
    compute_s_before_rollout_end: float  # forward/backward seconds, summed over replicas
    compute_s_after_rollout_end: float

    @property
    def overlap_share(self) -> float:
        """Share of the step's training compute (by tokens) done while rollout was still running."""
        return self.tokens_before_rollout_end / self.tokens_total if self.tokens_total else 0.0


def group_key(prompt: Prompt) -> tuple[int, int]:
    """A prompt group's place in a step's canonical order."""
    return prompt.epoch, prompt.uid


def replica_for(key: tuple[int, int], dp: int) -> int:
    """The data-parallel replica that trains the group of ``key`` (``group_key``) under a fixed
    assignment (``StreamTrainer.finish``): a function of the prompt alone."""
    return zlib.crc32("{}:{}".format(*key).encode()) % dp


class StreamTrainer:
    """Builds one optimizer step from groups fed in any order, split, or all at once."""

    def __init__(self, backend: Backend, cfg: TrainerConfig, *, reference: dict[str, torch.Tensor] | None = None,
                 clock: Callable[[], float] = time.time, row_width: int | None = None):
        # Wall-clock time: a streamed group counts as trained before the rollout ended only if its
        # training finished before that moment, which another rank (rank 0) observes.
        if cfg.kl_coef > 0 and reference is None:
            raise ValueError("trainer.kl_coef > 0 needs the reference policy's weights (reference=...)")
        self.backend, self.cfg, self.reference, self.clock = backend, cfg, reference, clock
        self.row_width = row_width  # see Trainer
        layout = backend.layout
        self._loss_fn = partial(micro_batch_loss, cfg=cfg, tp_group=layout.tp_group, vocab_size=backend.vocab_size,
                                cp_group=layout.cp_group if layout.cp > 1 else None)
        self._mismatch_shape = (len(cfg.mismatch.length_buckets) + 1, len(mismatch.STATS))
        self._ref_fn = partial(logprobs_only, tp_group=layout.tp_group, vocab_size=backend.vocab_size)
        self._open = False
        spec = backend.spec
        # (sparse layers, top-k) of a model whose routing the trainer replays
        self._experts = (len(spec.moe_layers), spec.experts_per_token) if cfg.routing_replay else None

    # -- one step -----------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        """A step has begun and not finished."""
        return self._open

    def begin(self) -> None:
        """Start a step: zero gradients and counters."""
        self.backend.zero_grad()
        self._sums = LossSums.zeros(self.backend.layout.device, self._mismatch_shape)
        # local counters: response tokens, groups and compute tokens
        self._counts = {k: 0 for k in ("resp_tokens", "groups", "tokens")}
        self._spans: list[tuple[float, float, int, int]] = []  # streamed: (start, end, tokens, groups)
        self._finish_s = 0.0
        self._started_at: float | None = None
        self._rollout_ended_at: float | None = None
        self._policy_on_host: dict[str, torch.Tensor] | None = None
        self._open = True

    def consume(self, groups: Sequence[Sequence[Sample]]) -> None:
        """Forward/backward on finished prompt groups now; gradients stay local.

        Every rank of one data-parallel replica (its TP/PP/CP peers) must be
        fed the same groups; different replicas may be fed anything.
        """
        self._require_open()
        if not groups:
            return
        start = self.clock()
        if self._started_at is None:
            self._started_at = start
        tokens = self._train([s for g in groups for s in with_advantages(g, self.cfg)], len(groups))
        self._spans.append((start, self.clock(), tokens, len(groups)))

    def end_rollout(self, at: float | None = None) -> None:
        """Mark the end of rollout, which happened at wall-clock time ``at`` (default: now). A rank
        learns of it by message, possibly while it still trains on groups fed before: only training
        finished by ``at`` counts as overlapping the rollout."""
        self._require_open()
        self._rollout_ended_at = self.clock() if at is None else at

    def finish(self, remaining: Sequence[Sequence[Sample]], *, fixed: bool = False) -> dict[str, float]:
        """Train on ``remaining`` (identical on every rank), reduce, normalise, step once.

        ``fixed``: each group is trained by the replica ``replica_for`` names, alone, in key order,
        as the stream feed hands it out under the deterministic race: then the update does not
        depend on which groups were streamed before the rollout ended (the split is timing), at the
        price of per-group micro-batches and replicas balanced by hash rather than by tokens.
        Otherwise the groups are packed together and spread to even out each replica's tokens.

        Collective over the data-parallel group. Returns the step's metrics,
        identical on every rank.
        """
        self._require_open()
        if self._rollout_ended_at is None:
            self.end_rollout()
        layout = self.backend.layout
        if fixed:
            start = self.clock()
            for group in sorted(remaining, key=lambda g: group_key(g[0].prompt)):
                if replica_for(group_key(group[0].prompt), layout.dp) == layout.dp_rank:
                    self._train(list(with_advantages(group, self.cfg)), 1)
            self._finish_s = self.clock() - start
            return self._reduce_and_step()
        samples = [s for g in remaining for s in with_advantages(g, self.cfg)]
        # replicas that streamed during rollout already did part of the work: even out the total
        done = torch.tensor([self._counts["tokens"]], dtype=torch.int64, device=layout.device)
        loads = [torch.zeros_like(done) for _ in range(layout.dp)]
        if layout.dp > 1:
            dist.all_gather(loads, done, group=layout.dp_group)
        mine = balance([sequence_length(s) for s in samples], layout.dp,
                       start=[int(x) for x in loads] if layout.dp > 1 else None)[layout.dp_rank]
        # groups are split across replicas; count each once (on replica 0) for the report
        start = self.clock()
        self._train([samples[i] for i in mine], len(remaining) if layout.dp_rank == 0 else 0)
        self._finish_s = self.clock() - start
        return self._reduce_and_step()

    # -- internals ----------------------------------------------------------------------------------

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError("call begin() before feeding a step, and only once per step")

    def _train(self, samples: list[Sample], num_groups: int) -> int:
        """Forward/backward on ``samples``; returns their compute tokens. Under expert parallelism
        every rank of the EP group runs it together, with or without samples (``Backend.conform``)."""
        mbs = plan_micro_batches(samples, budget=self.cfg.micro_batch_tokens,
                                 aggregation=self.cfg.loss_aggregation, layout=self.backend.micro_batch_layout,
                                 pad_multiple=self.backend.pad_multiple, row_width=self.row_width,
                                 experts=self._experts) if samples else []
        mbs = self.backend.conform(mbs)
        if mbs:
            if self.cfg.kl_coef > 0:
                self._attach_reference_logprobs(mbs)
            for result in self.backend.forward_backward(mbs, self._loss_fn):
                self._sums = self._sums + result
        tokens = sum(sequence_length(s) for s in samples)
        c = self._counts
        c["resp_tokens"] += sum(len(s.response_ids) for s in samples)
        c["groups"] += num_groups
        c["tokens"] += tokens
        return tokens

    def _overlap(self) -> list[float]:
        """This rank's groups and tokens trained before the rollout ended, and its training seconds
        before and after that moment."""
        ended = self._rollout_ended_at
        done = [(tokens, groups) for _, end, tokens, groups in self._spans if end <= ended]
        before_s = sum(max(0.0, min(end, ended) - start) for start, end, _, _ in self._spans)
        after_s = self._finish_s + sum(max(0.0, end - max(start, ended)) for start, end, _, _ in self._spans)
        return [sum(g for _, g in done), sum(t for t, _ in done), before_s, after_s]

    def _attach_reference_logprobs(self, mbs: list[MicroBatch]) -> None:
        # weights do not change within a step: copy them to host once, not once per streamed group
        if self._policy_on_host is None:
            self._policy_on_host = self.backend.params_to_host()
        with self.backend.swapped_params(self.reference, current=self._policy_on_host), torch.no_grad():
            ref = self.backend.forward_backward(mbs, self._ref_fn, forward_only=True)
        for mb, lp in zip(mbs, ref):  # empty off the last pipeline stage, which computes no loss
            mb.ref_logprobs = lp

    def _reduce_and_step(self) -> dict[str, float]:
        layout = self.backend.layout
        self._open = False
        self._policy_on_host = None
        counts = torch.tensor([*self._counts.values(), *self._overlap()], dtype=torch.float64, device=layout.device)
        sums, maxima = self._sums.as_vectors()
        if layout.dp > 1:
            dist.all_reduce(counts, group=layout.dp_group)
        # dp: each replica's own samples; cp: each context-parallel rank's share of every sequence;
        # pp: only the last stage computed the loss, so every stage gets its metrics
        for group in [g for g, n in ((layout.dp_group, layout.dp), (layout.cp_group, layout.cp),
                                     (layout.pp_group, layout.pp)) if n > 1]:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        total = dict(zip([*self._counts, "groups_before", "tokens_before"],
                         (int(x) for x in counts[:len(self._counts) + 2].tolist())))
        compute_before, compute_after = counts[len(self._counts) + 2:].tolist()
        if total["resp_tokens"] == 0:
            raise ValueError("the step holds no response tokens: nothing to train on")
        global_sums = LossSums.from_vectors(sums, maxima, self._mismatch_shape)
        # the loss's own counts: the mismatch correction may have rejected tokens, which leave the denominator
        denom = denominator(int(global_sums.tokens), int(global_sums.sequences), self.cfg.loss_aggregation)
        self.backend.reduce_grads(1.0 / max(denom, 1))
        # nothing left to learn from (every token rejected) is not a step: Adam would still move the weights
        loss_finite = math.isfinite(float(global_sums.objective)) and denom > 0
        result = self.backend.step() if loss_finite else None
        applied = result is not None and result.applied
        metrics = step_metrics(global_sums, self.cfg.loss_aggregation)
        gap = mismatch.metrics(global_sums.mismatch, self.cfg.mismatch)
        metrics.update({f"mismatch/{k}": v for k, v in gap.items()})
        if self.cfg.mismatch.correct != "off":
            metrics["mismatch/kept_token_frac"] = float(global_sums.tokens) / total["resp_tokens"]
            metrics["mismatch/is_weight_mean"] = float(global_sums.is_weight) / max(float(global_sums.tokens), 1.0)
        report = StreamReport(
            started_at=self._started_at, rollout_ended_at=self._rollout_ended_at,
            groups_before_rollout_end=total["groups_before"], groups_total=total["groups"],
            tokens_before_rollout_end=total["tokens_before"], tokens_total=total["tokens"],
            compute_s_before_rollout_end=compute_before, compute_s_after_rollout_end=compute_after)
        metrics.update(
            grad_norm=result.grad_norm if result is not None else float("nan"),
            skipped=0 if applied else 1,
            stream_groups_before_rollout_end=report.groups_before_rollout_end,
            stream_overlap_share=report.overlap_share,
            stream_compute_s_before=compute_before, stream_compute_s_after=compute_after)
        return metrics
