"""Multi-epoch simulation: every prompt of a trace trained once per epoch, per mode.

A step-based comparison (``run.run_mode``) measures rollout time per round; a
scheduler that routes prompts by what it saw of them in earlier epochs
(history-aware tail batching) only shows its effect over epochs. Here each
mode runs the real ``Scheduler`` over the modeled engines, the prompts served
in a seeded order per epoch, until every prompt of epochs 0..N-1 has been
kept once; the run goes on into epoch N only as far as tail batching needs
to drain the queued prompts of epoch N-1, and there responses take the
lengths of epoch N-1 (a trace need not cover epochs it does not measure).

Attribution: a round's seconds and generated/wasted tokens are split over
epochs by the shares of its kept groups; the shares of groups of epoch >= N
are dropped, so every figure covers epochs 0..N-1 exactly and two modes that
train the same prompts compare on equal work. ``rounds`` is the sum of those
shares (a round straddling two epochs counts partly in each).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from rollpacker.scheduler import RoundResult, RoundStats
from rollpacker.scheduler.config import HistoryConfig
from rollpacker.sim.run import SimCluster, SimSettings
from rollpacker.sim.traces import PromptLengths

FIGURES = ("rollout_seconds", "generated_tokens", "wasted_tokens", "wasted_token_fraction", "trained_prompts",
           "rounds")


@dataclass
class EpochFigures:
    rollout_seconds: float = 0.0
    generated_tokens: float = 0.0
    wasted_tokens: float = 0.0
    trained_prompts: int = 0
    rounds: float = 0.0

    @property
    def wasted_token_fraction(self) -> float:
        return self.wasted_tokens / self.generated_tokens if self.generated_tokens else 0.0

    def add(self, stats: RoundStats, share: float, kept: int) -> None:
        self.rollout_seconds += share * stats.rollout_seconds
        self.generated_tokens += share * stats.generated_tokens
        self.wasted_tokens += share * stats.wasted_tokens
        self.trained_prompts += kept
        self.rounds += share

    def __add__(self, other: EpochFigures) -> EpochFigures:
        return EpochFigures(self.rollout_seconds + other.rollout_seconds,
                            self.generated_tokens + other.generated_tokens, self.wasted_tokens + other.wasted_tokens,
                            self.trained_prompts + other.trained_prompts, self.rounds + other.rounds)

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in FIGURES}


@dataclass
class EpochRun:
    mode: str
    history: bool
    epochs: list[EpochFigures]
    trained: frozenset[tuple[int, int]]  # (prompt uid, epoch) of every kept group of epochs 0..N-1
    counters: dict[str, int]  # the scheduler's, over the whole run (epoch N included)

    @property
    def total(self) -> EpochFigures:
        return sum(self.epochs, EpochFigures())

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "history": self.history, "per_epoch": [f.as_dict() for f in self.epochs],
                "total": self.total.as_dict(), "counters": self.counters}


def run_epochs(mode: str, settings: SimSettings, trace: list[PromptLengths], epochs: int, *,
               history: HistoryConfig | None = None, shuffle_seed: int | None = None,
               on_round: Callable[[RoundResult], None] | None = None) -> EpochRun:
    """Rounds of ``mode`` until every prompt of epochs 0..``epochs``-1 is kept once.

    ``shuffle_seed`` None serves every epoch in trace order. A prompt kept
    twice in one epoch is a scheduler bug and raises, as does a run that
    needs far more rounds than the prompts account for.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    for prompt in trace:  # refuse a trace that misses a measured epoch before any round runs
        for epoch in range(epochs):
            prompt.lengths_in(epoch)
    cluster = SimCluster(mode, settings, trace, history=history, shuffle_seed=shuffle_seed, last_epoch=epochs - 1)
    pending = {(uid, e) for uid in range(len(trace)) for e in range(epochs)}
    figures = [EpochFigures() for _ in range(epochs)]
    trained: set[tuple[int, int]] = set()
    # Each round keeps P0 groups; the slack covers draining the queue at the end.
    max_rounds = 2 * -(-len(pending) // settings.p0) + 64
    while pending:
        if cluster.scheduler.counters["rounds"] >= max_rounds:
            raise RuntimeError(f"{mode}: {len(pending)} prompts of epochs < {epochs} still untrained after "
                               f"{max_rounds} rounds")
        result = cluster.run_round()
        if on_round is not None:
            on_round(result)
        kept = Counter(group[0].prompt.epoch for group in result.groups)
        for group in result.groups:
            key = (group[0].prompt.uid, group[0].prompt.epoch)
            if key[1] >= epochs:
                continue
            if key not in pending:
                raise RuntimeError(f"{mode}: round {result.index} kept prompt {key[0]} of epoch {key[1]} again")
            pending.remove(key)
            trained.add(key)
        for epoch, n in kept.items():
            if epoch < epochs:
                figures[epoch].add(result.stats, n / len(result.groups), n)
    return EpochRun(mode, bool(history and history.enabled), figures, frozenset(trained),
                    dict(cluster.scheduler.counters))


def _speedup(baseline: EpochFigures, other: EpochFigures) -> float:
    return baseline.rollout_seconds / other.rollout_seconds if other.rollout_seconds else 0.0


def compare(baseline: EpochRun, tail: EpochRun) -> dict[str, Any]:
    """Per-epoch and total figures of both runs, the speedup of ``tail`` over
    ``baseline`` (rollout seconds), whether both trained the same prompts,
    and how many prompts the tail run's history routed straight to the queue."""
    per_epoch = [{"epoch": e, "baseline": b.as_dict(), "tail_batching": t.as_dict(), "speedup": _speedup(b, t)}
                 for e, (b, t) in enumerate(zip(baseline.epochs, tail.epochs))]
    total_b, total_t = baseline.total, tail.total
    return {"history": tail.history, "per_epoch": per_epoch,
            "total": {"baseline": total_b.as_dict(), "tail_batching": total_t.as_dict(),
                      "speedup": _speedup(total_b, total_t)},
            "same_prompts": baseline.trained == tail.trained,
            "routed": tail.counters["routed"]}
