"""The interface of a round policy: which prompts a round launches, which
complete groups it keeps, and what replaces a group it drops.

Everything a policy does not decide is common to all modes and lives in the
round runner: dispatch, the race to ``target_groups`` kept groups, aborting
extras and leftovers, and deferring unfinished prompts to the queue.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

from rollpacker.sample import Prompt, SampleGroup
from rollpacker.scheduler.admission import FreshAdmission
from rollpacker.scheduler.config import SchedulerConfig
from rollpacker.scheduler.protocols import PromptSource
from rollpacker.scheduler.queue import LongPromptQueue
from rollpacker.scheduler.round import RoundKind


@dataclass(frozen=True)
class RoundSpec:
    kind: RoundKind
    prompts: list[Prompt]
    n_responses: int
    routed: int = 0  # prompts history sent to the long-prompt queue while choosing this round


class RoundPolicy(abc.ABC):
    """``admission`` picks a short round's fresh prompts (modes without short rounds ignore it)."""

    races = True  # short rounds race over-launched prompts, so a prompt's history can route it past the race

    def __init__(self, cfg: SchedulerConfig, admission: FreshAdmission) -> None:
        self.cfg = cfg
        self.admission = admission

    @abc.abstractmethod
    def next_round(self, queue: LongPromptQueue, source: PromptSource) -> RoundSpec:
        """Take the next round's prompts from the queue or the source."""

    def keeps(self, group: SampleGroup) -> bool:
        """Whether a complete, scored group joins the batch (False: filtered, counted)."""
        return True

    def replacement(self, kind: RoundKind, queue: LongPromptQueue, source: PromptSource) -> Prompt | None:
        """A prompt to launch in place of a filtered group, or None."""
        return None

    def state_dict(self) -> dict:
        return self.admission.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.admission.load_state_dict(state)
