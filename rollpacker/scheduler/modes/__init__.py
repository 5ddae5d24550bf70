"""Round policies, one per ``SchedulerConfig.mode``."""
from __future__ import annotations

from rollpacker.scheduler.admission import FreshAdmission
from rollpacker.scheduler.config import SchedulerConfig
from rollpacker.scheduler.modes.base import RoundPolicy, RoundSpec
from rollpacker.scheduler.modes.baseline import BaselinePolicy
from rollpacker.scheduler.modes.dynamic_sampling import DynamicSamplingPolicy
from rollpacker.scheduler.modes.tail_batching import TailBatchingPolicy

_POLICIES: dict[str, type[RoundPolicy]] = {
    "baseline": BaselinePolicy,
    "tail_batching": TailBatchingPolicy,
    "dynamic_sampling": DynamicSamplingPolicy,
}


def make_policy(cfg: SchedulerConfig, admission: FreshAdmission) -> RoundPolicy:
    return _POLICIES[cfg.mode](cfg, admission)


def races(mode: str) -> bool:
    """Whether ``mode``'s short rounds race prompts (``scheduler.history`` is inert where they do not)."""
    return _POLICIES[mode].races


__all__ = ["RoundPolicy", "RoundSpec", "BaselinePolicy", "TailBatchingPolicy", "DynamicSamplingPolicy",
           "make_policy", "races"]
