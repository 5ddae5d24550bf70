"""The score every scorer returns, and the closed set of reasons it may carry."""
from __future__ import annotations

from dataclasses import dataclass

OK = "ok"
WRONG_ANSWER = "wrong_answer"
NO_ANSWER = "no_answer"
TIMEOUT = "timeout"
CRASH = "crash"
SANDBOX_VIOLATION = "sandbox_violation"
ERROR = "error"  # the scorer itself failed, or the input could not be scored
REASONS = (OK, WRONG_ANSWER, NO_ANSWER, TIMEOUT, CRASH, SANDBOX_VIOLATION, ERROR)


@dataclass(frozen=True)
class Score:
    reward: float
    correct: bool
    reason: str
    seconds: float = 0.0  # scoring wall time, all attempts included
    detail: str = ""  # human-readable cause of a failure, for logs

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"Score.reason must be one of {REASONS}, got {self.reason!r}")

    @classmethod
    def passed(cls, seconds: float = 0.0) -> "Score":
        return cls(1.0, True, OK, seconds)

    @classmethod
    def failed(cls, reason: str, detail: str = "", seconds: float = 0.0) -> "Score":
        return cls(0.0, False, reason, seconds, detail)

    def to_json(self) -> dict:
        """The record the CLI writes: the four public fields."""
        return {"reward": self.reward, "correct": self.correct, "reason": self.reason,
                "seconds": round(self.seconds, 4)}
