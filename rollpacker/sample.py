"""The one record passed between stages: data -> rollout -> reward -> trainer.

A ``Sample`` is one response to one prompt.  The data pipeline fills the prompt
fields, the rollout engine the response fields, the reward pool the score
fields, and the trainer reads all of them.  ``prompt_uid`` is stable across
epochs and restarts (dataset index), so the prompt ledger can prove that no
prompt is lost or trained twice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class Prompt:
    """A prompt as served by the data pipeline (one row of the dataset)."""

    uid: int  # stable index of the row in its dataset
    input_ids: list[int]
    data_source: str
    ground_truth: Any = None  # answer string, or a list of code test cases
    extra_info: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0


@dataclass
class Sample:
    prompt: Prompt
    response_index: int  # 0..n-1 among the responses launched for this prompt
    response_ids: Sequence[int] = field(default_factory=list)  # as the engine's completion holds them
    rollout_logprobs: Sequence[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # reward
    reward: float | None = None
    correct: bool | None = None
    reward_reason: str | None = None  # "ok", "wrong_answer", "timeout", ...
    # timing, seconds on the scheduler's clock
    submitted_at: float = 0.0
    finished_at: float | None = None
    scored_at: float | None = None
    # filled by the trainer
    advantage: float | None = None

    @property
    def request_id(self) -> str:
        return f"p{self.prompt.uid}e{self.prompt.epoch}r{self.response_index}"

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    def replace(self, **changes: Any) -> "Sample":
        return dataclasses.replace(self, **changes)
