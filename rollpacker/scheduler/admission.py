"""Which fresh prompts a short round races, and how many responses each gets.

``FreshAdmission`` is tail batching as published: the next ⌈η_P·P0⌉ prompts
of the data, ⌈η_R·R0⌉ responses each. Its ⌈η_P·P0⌉ - P0 extra prompts are
the round's *budget* for the long-prompt queue: that many racers lose and
are deferred, their partial responses thrown away.

``HistoryAdmission`` reads the ``PromptHistory``: a prompt predicted long
skips the race and joins the long-prompt queue at once, and fills the
budget in place of a racer that would have been deferred; the round
over-launches only what is left of the budget, but at least ``eta_p_seen``.
The queue therefore fills at tail batching's pace (long rounds stay as
rare), while the prompts sent there generate nothing they throw away.
Responses per prompt are ⌈η⌉·R0 with η weighted between ``eta_r`` (unseen
prompts) and ``eta_r_seen``. A share of predicted-long prompts races anyway
as probes (``PromptHistory.precision``); routing pauses while they show the
prediction wrong. Both admissions only reorder prompts: every prompt taken
from the source is launched, queued or staged, and trained once, with the
weights of the step that trains it.

Bounded deferral: a routed prompt waits in the FIFO queue like a deferred
one, and a long round runs as soon as the queue holds P0 prompts (routing
stops there and the candidates already drawn are staged for the next short
round), so no prompt waits behind more than the P0 - 1 queued before it and
the routing of one short round.
"""
from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

from rollpacker.sample import Prompt
from rollpacker.scheduler.config import SchedulerConfig
from rollpacker.scheduler.history import PromptHistory
from rollpacker.scheduler.protocols import PromptSource
from rollpacker.scheduler.queue import LongPromptQueue
from rollpacker.scheduler.round import over_launch


@dataclass(frozen=True)
class ShortPick:
    prompts: list[Prompt]  # empty: the queue filled while picking, a long round runs first
    n_responses: int
    routed: int = 0  # prompts sent to the long-prompt queue while picking


class FreshAdmission:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg

    def short_round(self, queue: LongPromptQueue, source: PromptSource) -> ShortPick:
        """The next short round's prompts (none when a long round must run first)."""
        return ShortPick(source.take(over_launch(self.cfg.eta_p, self.cfg.p0)), over_launch(self.cfg.eta_r, self.cfg.r0))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("staged"):
            raise ValueError(f"checkpoint holds {len(state['staged'])} prompts drawn by history-aware admission and "
                             "not yet launched; resume with scheduler.history.enabled=true")


class HistoryAdmission(FreshAdmission):
    def __init__(self, cfg: SchedulerConfig, history: PromptHistory) -> None:
        super().__init__(cfg)
        self.history = history
        self._staged: list[Prompt] = []  # drawn and predicted short, not yet launched

    def short_round(self, queue: LongPromptQueue, source: PromptSource) -> ShortPick:
        candidates, routed = self._staged, 0
        self._staged = []
        while len(candidates) < self._launch_count(routed):
            if len(queue) >= self.cfg.p0:
                self._staged = candidates
                return ShortPick([], self.cfg.r0, routed)
            prompt = source.take(1)[0]
            if self.history.predicts_long(prompt.uid):
                if self.history.routing and not self._is_probe(prompt):
                    queue.push([prompt])
                    routed += 1
                    continue
                self.history.probe(prompt)
            candidates.append(prompt)
        unseen = self._unseen_share(candidates)
        eta_r = unseen * self.cfg.eta_r + (1 - unseen) * self.cfg.history.eta_r_seen
        return ShortPick(candidates, max(self.cfg.r0, over_launch(eta_r, self.cfg.r0)), routed)

    def _launch_count(self, routed: int) -> int:
        """P0 plus what ``routed`` left of the over-launch budget, at least ``eta_p_seen``'s."""
        p0 = self.cfg.p0
        budget = over_launch(self.cfg.eta_p, p0) - p0
        return p0 + max(over_launch(self.cfg.history.eta_p_seen, p0) - p0, budget - routed)

    def _is_probe(self, prompt: Prompt) -> bool:
        """A fixed ``probe_fraction`` of (prompt, epoch) pairs, the same on every rank and after a restart."""
        return zlib.crc32(f"{prompt.uid}:{prompt.epoch}".encode()) % 10_000 < self.cfg.history.probe_fraction * 10_000

    def _unseen_share(self, prompts: Sequence[Prompt]) -> float:
        return sum(not self.history.seen(p.uid) for p in prompts) / len(prompts)

    def state_dict(self) -> dict[str, Any]:
        return {"staged": [dataclasses.asdict(p) for p in self._staged]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._staged = [Prompt(**p) for p in state.get("staged", [])]
