"""Configuration of the rollout scheduler and the parallelism planner."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rollpacker.configlib import ConfigError


@dataclass
class PlannerConfig:
    enabled: bool = True
    short_tp: int = 1  # initial rollout TP for short rounds (best profiled)
    long_tp: int = 2  # initial rollout TP for long rounds
    grow_ratio: float = 1.05  # preemptions rising by more than this step over step -> double TP
    shrink_after_steps: int = 4  # steps with zero preemptions -> halve TP
    max_tp: int = 8  # a TP group never spans nodes: at most the GPUs per node

    def validate(self) -> None:
        for name in ("short_tp", "long_tp", "max_tp"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ConfigError(f"{name} must be a power of two >= 1, got {v}")
        if self.grow_ratio < 1:
            raise ConfigError(f"grow_ratio must be >= 1, got {self.grow_ratio}")


@dataclass
class SchedulerConfig:
    mode: Literal["baseline", "tail_batching", "dynamic_sampling"] = "tail_batching"
    p0: int = 128  # prompts per training step
    r0: int = 8  # responses per prompt
    eta_p: float = 1.25  # prompt over-launch factor in short rounds
    eta_r: float = 1.25  # response over-launch factor in short rounds
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    idle_poll_s: float = 0.005  # real clock: how long one engine poll may block when nothing finished

    def validate(self) -> None:
        if self.p0 < 1 or self.r0 < 1:
            raise ConfigError(f"p0 and r0 must be >= 1, got p0={self.p0} r0={self.r0}")
        if self.mode == "dynamic_sampling" and self.r0 < 2:
            raise ConfigError("r0 must be >= 2 for dynamic_sampling (zero-variance needs a group)")
        if self.idle_poll_s <= 0:
            raise ConfigError(f"idle_poll_s must be > 0, got {self.idle_poll_s}")
        for name in ("eta_p", "eta_r"):
            if getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be >= 1.0, got {getattr(self, name)}")
