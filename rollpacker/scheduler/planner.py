"""Parallelism planner: the rollout engines' layout for each round kind, TP size and, for a MoE
model, expert-parallel size.

Short rounds carry more concurrent requests than long ones, hence more
KV-cache pressure and preemptions, so each round kind has its own TP. A MoE
model's experts see the same contrast: a short round's many tokens per step
reach every expert, a long round's few reach few, so each kind has its own EP.

- Start: with a profile table, the layout whose modeled time for the round's
  work is lowest (ties: the smaller TP, then EP), the work being the round's
  requests x the mean response length observed so far (a quarter of the
  length limit before any round has run); without a table, the configured
  ``short_tp`` / ``long_tp`` and ``short_ep`` / ``long_ep`` (a baseline round,
  P0 x R0 like a long round, starts at the long ones).
- Online, per round kind, after each round of that kind: preemptions above
  ``grow_ratio`` x those of the previous round of the same kind (a rise from
  zero counts) double TP; ``shrink_after_steps`` consecutive rounds with no
  preemption halve it. Comparing a short round with the long round before it
  would read the round mix as pressure, hence per kind. A deterministic run
  (``scheduler.race``) does not apply it: preemptions depend on the timing.
- Every TP is a power of two, at most ``max_tp`` (a TP group never spans a
  node) and divides the number of rollout ranks. A kind keeps its EP across TP
  changes, capped at the TP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rollpacker.configlib import ConfigError
from rollpacker.scheduler.config import PlannerConfig, TPProfile
from rollpacker.scheduler.round import EngineLayout, RoundKind


@dataclass
class _KindState:
    tp: int
    ep: int = 1  # before the cap at tp
    last_preemptions: int | None = None
    zero_streak: int = 0


class ParallelismPlanner:
    def __init__(self, cfg: PlannerConfig, rollout_ranks: int, *, fixed_tp: int = 1, fixed_ep: int = 1,
                 profile: Sequence[TPProfile] = ()) -> None:
        self.cfg = cfg
        self.rollout_ranks = rollout_ranks
        self.fixed = EngineLayout(fixed_tp, min(fixed_ep, fixed_tp))
        self.profile = {EngineLayout(p.tp, p.ep): p for p in (profile or cfg.profile)}
        self._allowed = cfg.tp_choices(rollout_ranks, fixed_tp)
        checked = [("short_tp", cfg.short_tp), ("long_tp", cfg.long_tp)] if cfg.enabled else []
        for name, tp in [*checked, ("fixed_tp", fixed_tp)]:
            if tp not in self._allowed:
                raise ConfigError(f"planner {name}={tp} must be a power of two <= max_tp={cfg.max_tp} "
                                  f"dividing the {rollout_ranks} rollout ranks; allowed: {self._allowed}")
        self._kinds: dict[RoundKind, _KindState] = {}
        self._mean_response_tokens = 0.0  # of the last round's batch

    def layout_for(self, kind: RoundKind, *, requests: int, max_response_tokens: int) -> EngineLayout:
        if not self.cfg.enabled:
            return self.fixed
        if kind not in self._kinds:
            tokens = self._mean_response_tokens or max_response_tokens / 4
            self._kinds[kind] = self._initial(kind, requests, tokens)
        state = self._kinds[kind]
        return EngineLayout(state.tp, min(state.ep, state.tp))

    def observe(self, kind: RoundKind, preemptions: int | None, mean_response_tokens: float) -> None:
        """Apply the online rule after a round of ``kind`` with ``preemptions`` (None: not measured, the
        TP stays)."""
        if mean_response_tokens > 0:
            self._mean_response_tokens = mean_response_tokens
        state = self._kinds.get(kind)
        if not self.cfg.enabled or state is None or preemptions is None:
            return
        rising = state.last_preemptions is not None and preemptions > self.cfg.grow_ratio * state.last_preemptions
        if rising:
            state.tp = self._step(state.tp, up=True)
            state.zero_streak = 0
        elif preemptions == 0:
            state.zero_streak += 1
            if state.zero_streak >= self.cfg.shrink_after_steps:
                state.tp = self._step(state.tp, up=False)
                state.zero_streak = 0
        else:
            state.zero_streak = 0
        state.last_preemptions = preemptions

    def state_dict(self) -> dict[str, Any]:
        return {"kinds": {k.value: vars(s).copy() for k, s in self._kinds.items()},
                "mean_response_tokens": self._mean_response_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._kinds = {RoundKind(k): _KindState(**v) for k, v in state["kinds"].items()}
        self._mean_response_tokens = float(state["mean_response_tokens"])

    def _initial(self, kind: RoundKind, requests: int, tokens_per_request: float) -> _KindState:
        candidates = [layout for layout in self.profile if layout.tp in self._allowed]
        if not candidates:
            short = kind is RoundKind.SHORT
            return _KindState(self.cfg.short_tp if short else self.cfg.long_tp,
                              self.cfg.short_ep if short else self.cfg.long_ep)
        best = min(candidates, key=lambda layout: (self.profile[layout].round_seconds(
            self.rollout_ranks // layout.tp, requests, tokens_per_request), layout))
        return _KindState(best.tp, best.ep)

    def _step(self, tp: int, *, up: bool) -> int:
        i = self._allowed.index(tp) if tp in self._allowed else 0
        return self._allowed[min(i + 1, len(self._allowed) - 1) if up else max(i - 1, 0)]
