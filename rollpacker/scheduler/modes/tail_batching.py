"""Tail batching (DESIGN §1): short over-launched races, and long rounds of queued prompts."""
from __future__ import annotations

from rollpacker.scheduler.modes.base import RoundPolicy, RoundSpec, over_launch
from rollpacker.scheduler.protocols import PromptSource
from rollpacker.scheduler.queue import LongPromptQueue
from rollpacker.scheduler.round import RoundKind


class TailBatchingPolicy(RoundPolicy):
    """Long round when the queue holds >= P0 prompts: its first P0, exactly R0
    responses each, no speculation. Otherwise a short round of ⌈η_P·P0⌉ fresh
    prompts x ⌈η_R·R0⌉ responses; the runner keeps the first P0 to finish R0
    scored responses and defers every other launched prompt to the queue."""

    def next_round(self, queue: LongPromptQueue, source: PromptSource) -> RoundSpec:
        cfg = self.cfg
        if len(queue) >= cfg.p0:
            return RoundSpec(RoundKind.LONG, queue.pop(cfg.p0), cfg.r0)
        return RoundSpec(RoundKind.SHORT, source.take(over_launch(cfg.eta_p, cfg.p0)),
                         over_launch(cfg.eta_r, cfg.r0))
