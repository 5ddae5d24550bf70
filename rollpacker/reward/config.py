"""Configuration of the reward worker pools."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollpacker.configlib import ConfigError


@dataclass
class RewardConfig:
    num_workers: int = 2  # per pool; in training one pool per node, on its first rank, scores all its engines
    queue_size: int = 4096  # bounded submission queue: submit blocks when it is full
    start_method: Literal["forkserver", "spawn"] = "forkserver"  # never fork the trainer
    math_timeout: float = 5.0  # seconds per math sample
    # which part of a math response is its answer: its last \boxed{} (TRL's and DeepScaleR's reading),
    # or the last expression anywhere (veRL's math_verify scorer); rollpacker/reward/scorers/math_answer.py
    math_extract: Literal["boxed", "last_expression"] = "boxed"
    worker_grace: float = 5.0  # seconds beyond a sample's own budget before its worker counts as hung
    code_timeout: Literal["adaptive", "fixed"] = "adaptive"
    code_t_min: float = 2.0
    code_t_max: float = 30.0
    code_lambda: float = 1.5
    code_fixed_timeout: float = 30.0
    code_memory_mb: int = 1024  # address-space limit of a sandboxed program
    code_file_size_mb: int = 16  # largest file a sandboxed program may write
    code_max_processes: int = 16  # process-count limit (enforced by the kernel for non-root uids)
    code_output_limit_bytes: int = 1 << 20
    # As root, sandboxed programs of worker i run as uid sandbox_uid + i (uids nothing else may
    # use), never as root: with None, or where that cannot be arranged, code samples are refused
    # (scored "error").  Unprivileged pools keep their uid either way.  See reward/sandbox.py.
    sandbox_uid: int | None = 61000
    async_scoring: bool = True  # score each response as it finishes (False: after rollout)

    def validate(self) -> None:
        if self.num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.queue_size < 1:
            raise ConfigError(f"queue_size must be >= 1, got {self.queue_size}")
        for name in ("math_timeout", "worker_grace", "code_fixed_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.code_t_min <= self.code_t_max:
            raise ConfigError(f"need 0 < code_t_min <= code_t_max, got {self.code_t_min}, {self.code_t_max}")
        if self.code_lambda < 1:
            raise ConfigError(f"code_lambda must be >= 1, got {self.code_lambda}")
        for name in ("code_memory_mb", "code_file_size_mb", "code_max_processes", "code_output_limit_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sandbox_uid is not None and self.sandbox_uid < 1:
            raise ConfigError(f"sandbox_uid must be a non-root uid >= 1 or null, got {self.sandbox_uid}")
