"""Parallelism planner: the rollout TP size for each round kind.

Short rounds carry more concurrent requests than long ones, hence more
KV-cache pressure and preemptions, so each round kind has its own TP.

- Start: with a profile table, the TP whose modeled time for the round's
  work is lowest (ties: the smaller TP), the work being the round's
  requests x the mean response length observed so far (a quarter of the
  length limit before any round has run); without a table, the configured
  ``short_tp`` / ``long_tp`` (a baseline round, P0 x R0 like a long round,
  starts at ``long_tp``).
- Online, per round kind, after each round of that kind: preemptions above
  ``grow_ratio`` x those of the previous round of the same kind (a rise from
  zero counts) double TP; ``shrink_after_steps`` consecutive rounds with no
  preemption halve it. Comparing a short round with the long round before it
  would read the round mix as pressure, hence per kind. A deterministic run
  (``scheduler.race``) does not apply it: preemptions depend on the timing.
- Every TP is a power of two, at most ``max_tp`` (a TP group never spans a
  node) and divides the number of rollout ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rollpacker.configlib import ConfigError
from rollpacker.scheduler.config import PlannerConfig, TPProfile
from rollpacker.scheduler.round import RoundKind


@dataclass
class _KindState:
    tp: int
    last_preemptions: int | None = None
    zero_streak: int = 0


class ParallelismPlanner:
    def __init__(self, cfg: PlannerConfig, rollout_ranks: int, *, fixed_tp: int = 1,
                 profile: Sequence[TPProfile] = ()) -> None:
        self.cfg = cfg
        self.rollout_ranks = rollout_ranks
        self.fixed_tp = fixed_tp
        self.profile = {p.tp: p for p in (profile or cfg.profile)}
        self._allowed = cfg.tp_choices(rollout_ranks, fixed_tp)
        checked = [("short_tp", cfg.short_tp), ("long_tp", cfg.long_tp)] if cfg.enabled else []
        for name, tp in [*checked, ("fixed_tp", fixed_tp)]:
            if tp not in self._allowed:
                raise ConfigError(f"planner {name}={tp} must be a power of two <= max_tp={cfg.max_tp} "
                                  f"dividing the {rollout_ranks} rollout ranks; allowed: {self._allowed}")
        self._kinds: dict[RoundKind, _KindState] = {}
        self._mean_response_tokens = 0.0  # of the last round's batch

    def tp_for(self, kind: RoundKind, *, requests: int, max_response_tokens: int) -> int:
        if not self.cfg.enabled:
            return self.fixed_tp
        if kind not in self._kinds:
            tokens = self._mean_response_tokens or max_response_tokens / 4
            self._kinds[kind] = _KindState(self._initial(kind, requests, tokens))
        return self._kinds[kind].tp

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

    def _initial(self, kind: RoundKind, requests: int, tokens_per_request: float) -> int:
        candidates = [t for t in self._allowed if t in self.profile]
        if not candidates:
            return self.cfg.short_tp if kind is RoundKind.SHORT else self.cfg.long_tp
        return min(candidates, key=lambda t: (self.profile[t].round_seconds(
            self.rollout_ranks // t, requests, tokens_per_request), t))

    def _step(self, tp: int, *, up: bool) -> int:
        i = self._allowed.index(tp) if tp in self._allowed else 0
        return self._allowed[min(i + 1, len(self._allowed) - 1) if up else max(i - 1, 0)]
