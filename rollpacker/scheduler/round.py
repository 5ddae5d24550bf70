"""The records of one rollout round: what is planned, and what came out."""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

from rollpacker.sample import Prompt, Sample, SampleGroup


def over_launch(eta: float, n: int) -> int:
    """⌈eta·n⌉, robust to float noise (1.1 * 10 is 11.000000000000002)."""
    return math.ceil(round(eta * n, 9))


class RoundKind(str, enum.Enum):
    SHORT = "short"  # tail batching: over-launched race to P0 done prompts
    LONG = "long"  # the first P0 queued prompts, exactly R0 responses each, run to the limit
    BASELINE = "baseline"  # synchronous P0 x R0, waits for the longest response
    EVAL = "eval"  # validation: every response of every eval prompt, nothing races


@dataclass(frozen=True, order=True)
class EngineLayout:
    """How a round's engines split the model: ``tp`` ranks each, and a MoE model's experts in ``ep``
    blocks of whole experts, ``tp / ep`` ranks sharing each expert (``ep`` 1: every expert over all)."""

    tp: int
    ep: int = 1

    def __str__(self) -> str:
        return f"TP {self.tp}" + (f" EP {self.ep}" if self.ep > 1 else "")


@dataclass(frozen=True)
class RoundPlan:
    """One round as decided by ``Scheduler.plan_round``.

    The program regroups its rollout ranks into engines of ``tp`` ranks each (``layout``)
    before calling ``Scheduler.run_round`` with this plan.
    """

    index: int  # rounds planned before this one
    kind: RoundKind
    tp: int  # rollout tensor-parallel size chosen by the planner
    prompts: tuple[Prompt, ...]  # launched at the start, in launch order
    n_responses: int  # responses launched per prompt
    target_groups: int  # P0: the round ends when this many groups are kept
    ep: int = 1  # a MoE model's experts in this many blocks over each engine's ranks (the planner's too)

    @property
    def layout(self) -> EngineLayout:
        return EngineLayout(self.tp, self.ep)


@dataclass
class RoundStats:
    """Measurements of one round, on the scheduler's clock.

    ``bubble_fraction``: each engine has as many *slots* as the most requests
    it held outstanding (submitted, not yet finished or aborted) at any moment
    of the round. Slot-time is slots x round duration; a slot is busy while
    it holds an outstanding request. The bubble is the idle share of all
    engines' slot-time: 0 when every engine stays full until the round ends,
    close to 1 when a few stragglers keep the round open.
    """

    rollout_seconds: float = 0.0  # launch -> P0 groups complete (with async reward: generated and scored)
    reward_seconds: float = 0.0  # after-rollout scoring stage (synchronous reward mode only)
    bubble_fraction: float = 0.0
    generated_tokens: int = 0  # all response tokens the engines produced in this round
    batch_tokens: int = 0  # response tokens in the returned batch
    wasted_tokens: int = 0  # generated - batch: aborted partials, unused extras, deferred and filtered prompts
    preemptions: int = 0  # engine KV-cache preemptions in this round
    launched_prompts: int = 0
    launched_responses: int = 0
    kept_prompts: int = 0
    filtered_prompts: int = 0  # dynamic sampling: zero-variance groups dropped
    deferred_prompts: int = 0  # pushed to the long-prompt queue by this round
    queue_length: int = 0  # long-prompt queue after this round
    migrated_requests: int = 0  # moved off engines handed to the stream trainer
    migrated_tokens: int = 0  # tokens those requests had generated (kept; their KV rebuilt)
    handoff_fraction: float = 0.0  # share of the round's requests done at the hand-off (0: none)

    @property
    def round_seconds(self) -> float:
        return self.rollout_seconds + self.reward_seconds


class Outcome(str, enum.Enum):
    """What became of one launched request."""
    TRAINED = "trained"  # in a kept group
    FILTERED = "filtered"  # in a group dynamic sampling dropped (zero reward variance)
    ABORTED = "aborted"  # an over-launched extra: its group completed without it
    DEFERRED = "deferred"  # its prompt's group was incomplete when the round closed: the prompt is queued


@dataclass(frozen=True)
class RequestTrace:
    """One launched request: where and when it ran, in seconds since the round started."""
    sample: Sample
    outcome: Outcome
    placements: tuple[tuple[int, float, float], ...]  # (engine, start, end), one per engine that held it

    @property
    def migrated(self) -> bool:
        """Moved off an engine handed to the stream trainer, its tokens kept."""
        return len(self.placements) > 1


@dataclass
class RoundTrace:
    """Every request of a round, for the completions table and the rollout Gantt. ``requests`` (in
    launch order) is made from ``build`` when first read: a cluster's round has tens of thousands."""
    engines: int
    build: Callable[[], list[RequestTrace]]
    closed_at: float  # the round's rollout ended (its last requests aborted)
    handoff_at: float | None = None  # engines left for the stream trainer (None: none did)
    released: tuple[int, ...] = ()  # the engines that left

    @functools.cached_property
    def requests(self) -> list[RequestTrace]:
        return self.build()


@dataclass
class RoundResult:
    index: int
    kind: RoundKind
    tp: int
    kept: list[SampleGroup]  # P0 groups of R0 scored samples, in completion order (packed until read)
    filtered: list[Prompt] = field(default_factory=list)
    filtered_tokens: list[int] = field(default_factory=list)  # each filtered group's longest response
    deferred: list[Prompt] = field(default_factory=list)  # in launch order, now at the back of the queue
    stats: RoundStats = field(default_factory=RoundStats)
    trace: RoundTrace | None = None
    completed: list[SampleGroup | None] = field(default_factory=list)  # each launched group; None: deferred
    ep: int = 1  # the engines' expert-parallel size (RoundPlan.ep)

    @property
    def groups(self) -> list[list[Sample]]:
        """The kept groups' samples (unpacked on first read)."""
        return [g.samples for g in self.kept]

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.kept for s in g.samples]

    @property
    def num_samples(self) -> int:
        return sum(len(g) for g in self.kept)
