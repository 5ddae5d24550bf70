"""Configuration of the rollout scheduler and the parallelism planner."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rollpacker.configlib import ConfigError, require_power_of_two
from rollpacker.scheduler.round import EngineLayout


@dataclass(frozen=True)
class TPProfile:
    """Measured (``bench/system/profile_tp.py``) or modeled capacity of one engine layout: ``tp`` ranks
    and, for a MoE model, its experts in ``ep`` blocks over them."""

    tp: int
    decode_tokens_per_s: float  # saturated decode throughput of one engine
    kv_capacity_tokens: int  # KV-cache tokens one engine holds
    ep: int = 1
    # one request decoding alone: the speed no response can beat however few share the engine
    # (0: not measured, no such bound)
    request_tokens_per_s: float = 0.0

    def validate(self) -> None:
        require_power_of_two("tp", self.tp)
        require_power_of_two("ep", self.ep)
        if self.tp % self.ep:
            raise ConfigError(f"ep={self.ep} must divide tp={self.tp}: an engine's experts are split over its ranks")
        if self.decode_tokens_per_s <= 0 or self.kv_capacity_tokens < 1 or self.request_tokens_per_s < 0:
            raise ConfigError(f"decode_tokens_per_s and kv_capacity_tokens must be positive and request_tokens_per_s "
                              f">= 0, got {self.decode_tokens_per_s}, {self.kv_capacity_tokens} and "
                              f"{self.request_tokens_per_s}")

    def round_seconds(self, engines: int, requests: int, tokens_per_request: float) -> float:
        """Time to generate the round's tokens; over-subscribed KV is paid as recompute. A round of
        few requests per engine (a long round) does not fill the batch: it lasts at least as long as
        one response takes alone."""
        demand = requests / engines * tokens_per_request
        oversubscription = max(1.0, demand / self.kv_capacity_tokens)
        throughput = requests * tokens_per_request / (engines * self.decode_tokens_per_s) * oversubscription
        alone = tokens_per_request / self.request_tokens_per_s if self.request_tokens_per_s else 0.0
        return max(throughput, alone)


@dataclass
class PlannerConfig:
    enabled: bool = True
    short_tp: int = 1  # initial rollout TP for short rounds (best profiled)
    long_tp: int = 2  # initial rollout TP for long rounds
    # A MoE model's engines split its experts into this many blocks of whole experts, one per
    # tp/ep of their ranks (expert parallelism inside the engine), capped at the round's TP; 1
    # shards every expert over all the engine's ranks. Which is faster depends on the batch: a
    # short round's many tokens per step reach every expert (whole experts make larger GEMMs), a
    # long round's few reach few (sharded experts keep every rank busy), and on the kernels; profile
    # rows with ep and request_tokens_per_s let the planner choose per round kind from measurements.
    short_ep: int = 1
    long_ep: int = 1
    grow_ratio: float = 1.05  # preemptions rising by more than this step over step -> double TP
    shrink_after_steps: int = 4  # steps with zero preemptions -> halve TP
    max_tp: int = 8  # a TP group never spans nodes: at most the GPUs per node
    min_tp: int = 1  # smaller engines are not built (rollpacker.plan: weights that do not fit)
    # one row per layout (TP size, and EP size for a MoE model); with rows, a round kind starts at the
    # layout they predict fastest (short_tp/long_tp and short_ep/long_ep are then unused)
    profile: list[TPProfile] = field(default_factory=list)

    def validate(self) -> None:
        for name in ("short_tp", "long_tp", "max_tp", "min_tp", "short_ep", "long_ep"):
            require_power_of_two(name, getattr(self, name))
        if self.min_tp > self.max_tp:
            raise ConfigError(f"min_tp={self.min_tp} must be <= max_tp={self.max_tp}")
        if self.grow_ratio < 1:
            raise ConfigError(f"grow_ratio must be >= 1, got {self.grow_ratio}")
        layouts = [(row.tp, row.ep) for row in self.profile]
        if len(set(layouts)) != len(layouts):
            raise ConfigError(f"profile lists a layout (tp, ep) twice: {layouts}")

    def tp_choices(self, rollout_ranks: int, fixed_tp: int) -> list[int]:
        """Every rollout TP the planner may pick (each rank builds an engine for each): powers of two
        from ``min_tp`` to ``max_tp`` dividing the rollout ranks; only ``fixed_tp`` when the planner is off."""
        if not self.enabled:
            return [fixed_tp]
        return [1 << k for k in range(self.max_tp.bit_length())
                if 1 << k >= self.min_tp and rollout_ranks % (1 << k) == 0]

    def ep_sizes(self, fixed_ep: int) -> set[int]:
        """The expert-parallel sizes the planner may want, before the cap at a round's TP."""
        if not self.enabled:
            return {fixed_ep}
        return {self.short_ep, self.long_ep, *(row.ep for row in self.profile)}

    def layout_choices(self, rollout_ranks: int, fixed_tp: int, fixed_ep: int = 1) -> list[EngineLayout]:
        """Every engine layout the planner may pick (each rank builds an engine for each): every TP of
        ``tp_choices`` with each EP it may want, capped at that TP."""
        eps = self.ep_sizes(fixed_ep)
        return sorted({EngineLayout(tp, min(ep, tp)) for tp in self.tp_choices(rollout_ranks, fixed_tp)
                       for ep in eps})


@dataclass
class HistoryConfig:
    """History-aware tail batching (``rollpacker.scheduler.history``): prompts whose earlier attempt
    showed them long skip the short race and fill the over-launch budget in place of racers. Inert in
    the baseline mode, which has no race to skip."""

    enabled: bool = False
    # predicted long: last seen longer than margin x the short rounds' closing length
    margin: float = 2.0
    # the over-launch left when routed prompts fill the eta_p budget (1.0: none)
    eta_p_seen: float = 1.0
    # response over-launch for prompts history has seen (unseen prompts keep eta_r)
    eta_r_seen: float = 1.25
    # the races' closing length: the median over this many recent short rounds of their longest kept response
    cutoff_rounds: int = 8
    # share of predicted-long prompts raced anyway, to measure how often the prediction is right
    probe_fraction: float = 0.1
    # routing pauses while probes lose their race less often than this
    min_precision: float = 0.5

    def validate(self) -> None:
        if self.margin <= 0:
            raise ConfigError(f"scheduler.history.margin must be > 0, got {self.margin}")
        for name in ("eta_p_seen", "eta_r_seen"):
            if getattr(self, name) < 1.0:
                raise ConfigError(f"scheduler.history.{name} must be >= 1.0 (a round needs P0 x R0), "
                                  f"got {getattr(self, name)}")
        if self.cutoff_rounds < 1:
            raise ConfigError(f"scheduler.history.cutoff_rounds must be >= 1, got {self.cutoff_rounds}")
        for name in ("probe_fraction", "min_precision"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"scheduler.history.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass
class SchedulerConfig:
    mode: Literal["baseline", "tail_batching", "dynamic_sampling"] = "tail_batching"
    p0: int = 128  # prompts per training step
    r0: int = 8  # responses per prompt
    eta_p: float = 1.25  # prompt over-launch factor in short rounds
    eta_r: float = 1.25  # response over-launch factor in short rounds
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)
    idle_poll_s: float = 0.005  # real clock: how long one engine poll may block when nothing finished
    # How a short round decides which prompts finished first (rollpacker/scheduler/group_race.py):
    # deterministic: by response lengths in tokens, so a run is reproducible from its config and seed
    #   whatever the machine's timing; the round waits until no running response can still beat the
    #   kept ones (the extra tokens are its cost, bench/system/race.py). The lengths themselves are
    #   reproducible only where the engine samples from each request's seed (RolloutConfig.seeded:
    #   sglang needs rollout.sglang_deterministic_inference). Not in dynamic_sampling.
    # first_finished: by the wall clock (reward latency included): no waiting, but which prompts train
    #   when, and so the weights, change with the machine's timing.
    # auto: deterministic on a real clock with seeded engines; first_finished with unseeded SGLang
    #   (its lengths vary run to run anyway), in dynamic_sampling and on the simulator's virtual
    #   clock (which is reproducible already).
    race: Literal["auto", "deterministic", "first_finished"] = "auto"

    def races_by_length(self, seeded: bool, *, virtual_clock: bool = False) -> bool:
        """Whether ``race`` resolves to the deterministic race, with engines that sample from each
        request's seed (``seeded``, ``RolloutConfig.seeded``) or not, on the simulator's clock or not."""
        if self.race != "auto":
            return self.race == "deterministic"
        return seeded and self.mode != "dynamic_sampling" and not virtual_clock

    def validate(self) -> None:
        if self.p0 < 1 or self.r0 < 1:
            raise ConfigError(f"p0 and r0 must be >= 1, got p0={self.p0} r0={self.r0}")
        if self.mode == "dynamic_sampling" and self.r0 < 2:
            raise ConfigError("r0 must be >= 2 for dynamic_sampling (zero-variance needs a group)")
        if self.race not in ("auto", "deterministic", "first_finished"):
            raise ConfigError(f"race must be auto, deterministic or first_finished, got {self.race!r}")
        if self.race == "deterministic" and self.mode == "dynamic_sampling":
            raise ConfigError("race=deterministic does not run dynamic_sampling, whose replacement prompts start "
                              "mid-round; use race=first_finished (or auto)")
        if self.idle_poll_s <= 0:
            raise ConfigError(f"idle_poll_s must be > 0, got {self.idle_poll_s}")
        for name in ("eta_p", "eta_r"):
            if getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be >= 1.0, got {getattr(self, name)}")
        self.history.validate()
