"""Run the real scheduler over modeled engines: baseline vs tail batching."""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from rollpacker.rollout.config import RolloutConfig
from rollpacker.sample import Prompt
from rollpacker.scheduler import ListPromptSource, LocalFleet, RoundKind, RoundResult, RoundStats, Scheduler, VirtualClock
from rollpacker.scheduler.config import HistoryConfig, PlannerConfig, SchedulerConfig
from rollpacker.scheduler.handoff import HandoffPolicy
from rollpacker.sim.engine import SimEngine
from rollpacker.sim.perf import H800, QWEN25, DecodeCost, Efficiency, PerfModel
from rollpacker.sim.reward import SimRewardSink
from rollpacker.sim.traces import LengthOracle, PromptLengths


@dataclass
class SimSettings:
    model: str = "14b"  # key of perf.QWEN25
    gpus: int = 32
    tp: int = 2  # rollout TP (fixed unless the planner is on)
    p0: int = 128
    r0: int = 8
    eta_p: float = 1.25
    eta_r: float = 1.25
    limit: int = 16384  # max response length
    rounds: int = 10  # per mode; 10 = two full 4-short + 1-long cycles at eta 1.25
    planner: bool = False  # tail batching: per-round-kind TP from the modeled profile + the online rule
    max_tp: int = 8  # GPUs per node
    seed: int = 0
    efficiency: Efficiency = field(default_factory=Efficiency)
    race: str = "auto"  # scheduler.race (auto: the wall-clock race, reproducible on the virtual clock)

    def validate(self) -> None:
        if self.model not in QWEN25:
            raise ValueError(f"model must be one of {sorted(QWEN25)}, got {self.model!r}")
        if self.gpus % self.tp:
            raise ValueError(f"tp={self.tp} must divide gpus={self.gpus}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")


@dataclass
class RoundRow:
    index: int
    kind: str
    tp: int
    stats: RoundStats
    max_over_median: float  # longest / median response length generated into the batch


class SimCluster:
    """The real ``Scheduler`` of one mode over modeled engines on a fresh virtual clock.

    ``history`` configures history-aware tail batching (modes other than the
    baseline); ``shuffle_seed`` serves each epoch of the trace in its own
    seeded order (None: trace order every epoch); ``last_epoch``: see
    ``LengthOracle``. ``async_reward``: a prompt is done when its responses are generated and
    scored (False: the kept samples are scored in a stage after the round); ``reward`` scores them
    (default: at once, on unlimited workers); ``cost(tp)``: an engine's step times at that TP
    (default: ``PerfModel`` of the settings' model on H800s).
    """

    def __init__(self, mode: str, settings: SimSettings, trace: list[PromptLengths], *,
                 history: HistoryConfig | None = None, shuffle_seed: int | None = None,
                 last_epoch: int | None = None, async_reward: bool = True,
                 reward: Callable[[VirtualClock], SimRewardSink] = SimRewardSink,
                 cost: Callable[[int], DecodeCost] | None = None) -> None:
        settings.validate()
        self.settings = settings
        self.cost = cost or (lambda tp: PerfModel(QWEN25[settings.model], H800, tp, settings.efficiency))
        self.clock = VirtualClock()
        self.oracle = LengthOracle(trace, seed=settings.seed, last_epoch=last_epoch)
        source = ListPromptSource([Prompt(uid=i, input_ids=[0] * p.prompt_length, data_source="trace")
                                   for i, p in enumerate(trace)], shuffle_seed=shuffle_seed)
        planner_on = settings.planner and mode != "baseline"
        cfg = SchedulerConfig(mode=mode, p0=settings.p0, r0=settings.r0, eta_p=settings.eta_p, eta_r=settings.eta_r,
                              planner=PlannerConfig(enabled=planner_on, short_tp=settings.tp, long_tp=settings.tp,
                                                    max_tp=settings.max_tp),
                              history=history or HistoryConfig(), race=settings.race)
        rollout = RolloutConfig(tp=settings.tp, max_response_length=settings.limit)
        profile = modeled_profile(settings) if planner_on else ()
        self.scheduler = Scheduler(cfg, rollout, source, rollout_ranks=settings.gpus, profile=profile,
                                   async_reward=async_reward)
        self.reward = reward(self.clock)

    def run_round(self, stream: bool = False) -> RoundResult:
        """The next round; ``stream``: a long round may hand engines to the stream trainer (any but
        engine 0, the coordinator's, the last first; the trace says when and which)."""
        plan = self.scheduler.plan_round()
        perf = self.cost(plan.tp)
        engines = [SimEngine(perf, self.clock, self.oracle, engine_id=i)
                   for i in range(self.settings.gpus // plan.tp)]
        handoff = (HandoffPolicy(candidates=tuple(range(len(engines) - 1, 0, -1)), on_release=lambda released: None)
                   if stream else None)
        return self.scheduler.run_round(plan, LocalFleet(engines, self.clock, self.reward), handoff=handoff)


def run_mode(mode: str, settings: SimSettings, trace: list[PromptLengths], *,
             on_round: Callable[[RoundResult], None] | None = None) -> list[RoundRow]:
    """``settings.rounds`` rounds of ``mode`` over the trace (cycled), on a fresh virtual clock;
    ``on_round`` sees each round's result (a progress bar)."""
    cluster = SimCluster(mode, settings, trace)
    rows = []
    for _ in range(settings.rounds):
        result = cluster.run_round()
        if on_round is not None:
            on_round(result)
        lengths = sorted(s.num_response_tokens for s in result.samples)
        rows.append(RoundRow(result.index, result.kind.value, result.tp, result.stats,
                             lengths[-1] / max(1.0, statistics.median(lengths))))
    return rows


def modeled_profile(settings: SimSettings) -> list:
    """Planner profile rows from the performance model, at the concurrency of
    a baseline round and the mean response length of the long-tail model."""
    model = QWEN25[settings.model]
    rows = []
    tp = 1
    while tp <= settings.max_tp:
        if settings.gpus % tp == 0:
            try:
                perf = PerfModel(model, H800, tp, settings.efficiency)
            except ValueError:  # weights do not fit at this TP
                tp *= 2
                continue
            batch = max(1, settings.p0 * settings.r0 * tp // settings.gpus)
            rows.append(perf.profile(batch, settings.limit // 16))
        tp *= 2
    return rows


def summarize(baseline: list[RoundRow], tail: list[RoundRow]) -> dict[str, Any]:
    def mean(rows: list[RoundRow]) -> float:
        return statistics.fmean(r.stats.round_seconds for r in rows) if rows else 0.0

    short = [r for r in tail if r.kind == RoundKind.SHORT.value]
    long = [r for r in tail if r.kind == RoundKind.LONG.value]
    base_s, tail_s = mean(baseline), mean(tail)
    return {
        "baseline_mean_s": base_s,
        "tail_mean_s": tail_s,
        "short_mean_s": mean(short),
        "long_mean_s": mean(long),
        "speedup": base_s / tail_s if tail_s else 0.0,
        "short_round_speedup": base_s / mean(short) if short else 0.0,
        "baseline_bubble": statistics.fmean(r.stats.bubble_fraction for r in baseline),
        "tail_bubble": statistics.fmean(r.stats.bubble_fraction for r in tail),
        "baseline_max_over_median": statistics.fmean(r.max_over_median for r in baseline),
        "tail_wasted_fraction": (sum(r.stats.wasted_tokens for r in tail)
                                 / max(1, sum(r.stats.generated_tokens for r in tail))),
    }


def row_dict(row: RoundRow) -> dict[str, Any]:
    return {"index": row.index, "kind": row.kind, "tp": row.tp, "max_over_median": row.max_over_median,
            **dataclasses.asdict(row.stats)}
