"""Tail batching: short over-launched races, and long rounds of queued prompts."""
from __future__ import annotations

from rollpacker.scheduler.modes.base import RoundPolicy, RoundSpec
from rollpacker.scheduler.protocols import PromptSource
from rollpacker.scheduler.queue import LongPromptQueue
from rollpacker.scheduler.round import RoundKind


class TailBatchingPolicy(RoundPolicy):
    """Long round when the queue holds >= P0 prompts: its first P0, exactly R0
    responses each, no speculation. Otherwise a short round of the fresh
    prompts the admission picks (⌈η_P·P0⌉ x ⌈η_R·R0⌉ without history); the
    runner keeps the first P0 to finish R0 scored responses and defers every
    other launched prompt to the queue."""

    def next_round(self, queue: LongPromptQueue, source: PromptSource) -> RoundSpec:
        routed = 0
        if len(queue) < self.cfg.p0:
            pick = self.admission.short_round(queue, source)
            if pick.prompts:
                return RoundSpec(RoundKind.SHORT, pick.prompts, pick.n_responses, pick.routed)
            routed = pick.routed
        return RoundSpec(RoundKind.LONG, queue.pop(self.cfg.p0), self.cfg.r0, routed)
