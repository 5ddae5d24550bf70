"""Which fresh prompts a short round races, and how many responses each gets.

``FreshAdmission`` is tail batching as published: the next ⌈η_P·P0⌉ prompts
of the data, ⌈η_R·R0⌉ responses each. ``HistoryAdmission`` reads the
``PromptHistory``: a prompt predicted long skips the race and joins the
long-prompt queue at once (it would only have lost the race and been
regenerated from scratch there), and the over-launch shrinks to
``eta_p_seen`` / ``eta_r_seen`` for the share of the round history predicts
short. Both only reorder prompts: every prompt taken from the source is
launched, queued or staged, and trained once, with the weights of the step
that trains it.

Bounded deferral: a routed prompt waits in the FIFO queue like a deferred
one, and a long round runs as soon as the queue holds P0 prompts (routing
stops there and the candidates already drawn are staged for the next short
round), so no prompt waits behind more than the P0 - 1 queued before it and
the routing of one short round.
"""
from __future__ import annotations

import dataclasses
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
        while len(candidates) < self._launch_count(candidates):
            if len(queue) >= self.cfg.p0:
                self._staged = candidates
                return ShortPick([], self.cfg.r0, routed)
            prompt = source.take(1)[0]
            if self.history.predicts_long(prompt.uid):
                queue.push([prompt])
                routed += 1
            else:
                candidates.append(prompt)
        unseen = self._unseen_share(candidates)
        eta_r = unseen * self.cfg.eta_r + (1 - unseen) * self.cfg.history.eta_r_seen
        return ShortPick(candidates, max(self.cfg.r0, over_launch(eta_r, self.cfg.r0)), routed)

    def _launch_count(self, candidates: Sequence[Prompt]) -> int:
        """P0 plus the over-launch of the first P0 candidates: η_P for unseen, ``eta_p_seen`` for the others."""
        p0 = self.cfg.p0
        if len(candidates) < p0:
            return p0
        unseen = self._unseen_share(candidates[:p0])
        return max(p0, over_launch(unseen * self.cfg.eta_p + (1 - unseen) * self.cfg.history.eta_p_seen, p0))

    def _unseen_share(self, prompts: Sequence[Prompt]) -> float:
        return sum(not self.history.seen(p.uid) for p in prompts) / len(prompts)

    def state_dict(self) -> dict[str, Any]:
        return {"staged": [dataclasses.asdict(p) for p in self._staged]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._staged = [Prompt(**p) for p in state.get("staged", [])]
