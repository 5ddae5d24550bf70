"""Configuration of the reward worker pools."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollpacker.configlib import ConfigError


@dataclass
class RewardConfig:
    num_workers: int = 2
    queue_size: int = 4096  # bounded submission queue
    math_timeout: float = 5.0  # seconds per math sample
    code_timeout: Literal["adaptive", "fixed"] = "adaptive"
    code_t_min: float = 2.0
    code_t_max: float = 30.0
    code_lambda: float = 1.5
    code_fixed_timeout: float = 30.0
    code_memory_mb: int = 1024
    code_output_limit_bytes: int = 1 << 20
    async_scoring: bool = True  # score each response as it finishes (False: after rollout)

    def validate(self) -> None:
        if self.num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0 < self.code_t_min <= self.code_t_max:
            raise ConfigError(f"need 0 < code_t_min <= code_t_max, got {self.code_t_min}, {self.code_t_max}")
        if self.code_lambda < 1:
            raise ConfigError(f"code_lambda must be >= 1, got {self.code_lambda}")
