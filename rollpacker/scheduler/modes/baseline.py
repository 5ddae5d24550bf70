"""Synchronous baseline (what veRL does): P0 fresh prompts x R0 responses, wait for all."""
from __future__ import annotations

from rollpacker.scheduler.modes.base import RoundPolicy, RoundSpec
from rollpacker.scheduler.protocols import PromptSource
from rollpacker.scheduler.queue import LongPromptQueue
from rollpacker.scheduler.round import RoundKind


class BaselinePolicy(RoundPolicy):
    races = False

    def next_round(self, queue: LongPromptQueue, source: PromptSource) -> RoundSpec:
        return RoundSpec(RoundKind.BASELINE, source.take(self.cfg.p0), self.cfg.r0)
