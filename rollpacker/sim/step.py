"""The whole training step on the modeled cluster: rollout, reward, training and weight sync.

The rollout (and, where reward runs during it, the scoring) is the real scheduler over modeled
engines (``run.SimCluster``); training, the weight sync and the phase switch are costed here, per
round, from the tokens the round kept. Components are added in the order of the published ablation
(``ABLATION``), each row keeping the ones above it:

- the synchronous baseline (what veRL does): P0 x R0 responses to the longest, then a reward stage
  that scores the batch on the CPU workers, then training;
- tail batching, reward still a stage after the round;
- asynchronous reward: each response is scored as it finishes, and a prompt is done only once its
  responses are generated *and* scored, so a slow scorer defers its prompt to a long round;
- the parallelism planner: the rollout TP per round kind;
- the stream trainer: in a long round, engines handed to training train the groups already done
  while the others generate; what is left trains on every GPU after the round.

The costs (``StepCosts``) are stated assumptions, each a flag of ``rollpacker-sim --end-to-end``:
training runs at ``mfu`` of the GPUs' peak bf16 FLOPs with ``flops_per_token`` x params FLOPs per
trained token (6 for forward and backward, 2 for the old log-probs' forward); the weight sync moves
the bf16 weights at ``sync_bytes_per_s`` after a fixed ``switch_s`` (offload and reload of the
training state, the engines' memory released and resumed); a response's score takes ``reward_s`` of
one of ``reward_workers`` CPU workers, except in ``reward_hang_prompts`` of the prompts, where half
the responses run into the scorer's fixed ``reward_hang_s`` timeout (code that never ends).
Not modeled: the optimizer step and gradient all-reduce (small beside forward and backward), the
trainer's own layout (training uses every GPU at one MFU) and the stream trainer's wish for whole
training replicas.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from rollpacker.sample import Sample
from rollpacker.scheduler.round import RoundResult
from rollpacker.sim.perf import H800, QWEN25
from rollpacker.sim.reward import SimRewardSink
from rollpacker.sim.run import SimCluster, SimSettings
from rollpacker.sim.traces import PromptLengths


@dataclass(frozen=True)
class Component:
    key: str
    label: str
    mode: str
    async_reward: bool
    planner: bool
    stream: bool


ABLATION = (
    Component("baseline", "synchronous baseline", "baseline", False, False, False),
    Component("tail_batching", "tail batching", "tail_batching", False, False, False),
    Component("async_reward", "+ async reward", "tail_batching", True, False, False),
    Component("planner", "+ parallelism planner", "tail_batching", True, True, False),
    Component("stream", "+ stream trainer", "tail_batching", True, True, True),
)


@dataclass(frozen=True)
class StepCosts:
    mfu: float = 0.35
    flops_per_token: float = 8.0
    switch_s: float = 4.0
    sync_bytes_per_s: float = 50e9
    reward_workers: int = 128
    reward_s: float = 1.0
    reward_hang_s: float = 30.0
    reward_hang_prompts: float = 0.05

    def validate(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")
        if self.reward_workers < 1:
            raise ValueError(f"reward_workers must be >= 1, got {self.reward_workers}")
        if not 0 <= self.reward_hang_prompts <= 1:
            raise ValueError(f"reward_hang_prompts must be in [0, 1], got {self.reward_hang_prompts}")

    def reward_latency(self, sample: Sample) -> float:
        """Seconds of one worker to score ``sample``: the same for a prompt's response in every mode."""
        if _unit(f"hang:{sample.prompt.uid}") < self.reward_hang_prompts and \
                _unit(f"hang:{sample.prompt.uid}:{sample.response_index}") < 0.5:
            return self.reward_hang_s
        return self.reward_s


def _unit(key: str) -> float:
    """A uniform draw in [0, 1) fixed by ``key`` (not by the order of the calls)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2 ** 64


@dataclass
class StepRow:
    kind: str
    tp: int
    rollout_s: float  # the round, with the scoring that happens during it
    reward_s: float  # the reward stage after the round (synchronous reward only)
    train_s: float  # training after the round
    streamed_tokens: int  # trained by the stream trainer before the round ended
    trained_tokens: int
    sync_s: float

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.reward_s + self.train_s + self.sync_s


def streamed(done: list[tuple[float, int]], handoff_at: float | None, closed_at: float, tokens_per_s: float) -> int:
    """Tokens the stream trainer trains before the round closes at ``closed_at``: from ``handoff_at``
    on, at ``tokens_per_s``, each group (``(done at, tokens)``) once it is done, in that order."""
    if handoff_at is None:
        return 0
    t, trained = handoff_at, 0.0
    for at, tokens in sorted(done):
        t = max(t, at)
        if t >= closed_at:
            break
        take = min(float(tokens), (closed_at - t) * tokens_per_s)
        trained, t = trained + take, t + take / tokens_per_s
    return int(trained)


class StepModel:
    """One component's steps on one trace: the scheduler's rounds plus the costs around them."""

    def __init__(self, component: Component, settings: SimSettings, trace: list[PromptLengths],
                 costs: StepCosts) -> None:
        costs.validate()
        self.component = component
        self.settings = dataclasses.replace(settings, planner=component.planner)
        model = QWEN25[settings.model]
        self.gpu_tokens_per_s = costs.mfu * H800.bf16_flops / (costs.flops_per_token * model.params)
        self.sync_s = costs.switch_s + model.weight_bytes / costs.sync_bytes_per_s
        reward = functools.partial(SimRewardSink, latency_fn=costs.reward_latency, workers=costs.reward_workers)
        self.cluster = SimCluster(component.mode, self.settings, trace, async_reward=component.async_reward,
                                  reward=reward)

    def step(self) -> StepRow:
        start = self.cluster.clock.now()
        result = self.cluster.run_round(stream=self.component.stream)
        tokens = [(max(_done_at(s) for s in g.samples) - start, sum(len(s.prompt.input_ids) + s.num_response_tokens
                                                                  for s in g.samples)) for g in result.kept]
        total = sum(n for _, n in tokens)
        trace = result.trace
        released_gpus = len(trace.released) * result.tp
        early = streamed(tokens, trace.handoff_at, trace.closed_at, released_gpus * self.gpu_tokens_per_s)
        return StepRow(kind=result.kind.value, tp=result.tp, rollout_s=result.stats.rollout_seconds,
                       reward_s=result.stats.reward_seconds,
                       train_s=(total - early) / (self.settings.gpus * self.gpu_tokens_per_s),
                       streamed_tokens=early, trained_tokens=total, sync_s=self.sync_s)


def _done_at(sample: Sample) -> float:
    return sample.scored_at if sample.scored_at is not None else sample.finished_at or 0.0


def run_ablation(settings: SimSettings, trace: list[PromptLengths], costs: StepCosts = StepCosts(), *,
                 on_round: Callable[[RoundResult | StepRow], None] | None = None) -> dict[str, list[StepRow]]:
    """``settings.rounds`` steps of every component of ``ABLATION`` on the same trace."""
    rows: dict[str, list[StepRow]] = {}
    for component in ABLATION:
        model = StepModel(component, settings, trace, costs)
        rows[component.key] = []
        for _ in range(settings.rounds):
            rows[component.key].append(model.step())
            if on_round is not None:
                on_round(rows[component.key][-1])
    return rows


PHASES = ("rollout_s", "reward_s", "train_s", "sync_s", "step_s")


def summarize_steps(rows: dict[str, list[StepRow]]) -> dict[str, dict[str, float]]:
    """Per component: the mean seconds of each phase per step, the speedup over the baseline and the
    share of training the stream trainer did during rollout."""
    out = {}
    for key, steps in rows.items():
        out[key] = {phase: statistics.fmean(getattr(s, phase) for s in steps) for phase in PHASES}
        out[key]["streamed_share"] = sum(s.streamed_tokens for s in steps) / max(1, sum(s.trained_tokens for s in steps))
    for key in out:
        out[key]["speedup"] = out["baseline"]["step_s"] / out[key]["step_s"]
    return out


def step_dict(row: StepRow) -> dict[str, Any]:
    return {**dataclasses.asdict(row), "step_s": row.step_s}
