"""Configuration of the prompt data pipeline."""
from __future__ import annotations

from dataclasses import dataclass, field

from rollpacker.configlib import ConfigError


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    max_prompt_length: int = 1024  # tokens, after the chat template
    apply_chat_template: bool = True
    shuffle: bool = True
    seed: int = 1

    def validate(self) -> None:
        if not self.train_files:
            raise ConfigError("train_files must name at least one JSONL or Parquet file")
        if self.max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length must be >= 1, got {self.max_prompt_length}")
