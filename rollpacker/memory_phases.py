"""Phase hand-offs between rollout and training on the same devices.

One explicit state machine per rank. The trainer and the rollout engines
share the accelerator, so each phase keeps only its own memory resident::

    TRAIN --------------> SYNC ---------------> ROLLOUT ------------> TRAIN
          optimizer state      trainer params           engines released,
          offloaded, engine    offloaded, engine        trainer onloaded
          weights resumed      KV resumed
          (for the weight push)

In SYNC the engine's weights share the device with the trainer's params alone: the push reads
nothing else, and the optimizer's state (main weights and moments, most of the trainer's bytes)
waits on host until the next TRAIN.

An engine of TP > 1 spans the devices of several ranks, and its leader alone releases and resumes
its memory on all of them. So between each trainer offload and the engine's resume that follows it,
and between the engine's release and the trainer's onload, the ranks of the engine wait for each
other (``barrier``): otherwise a follower could onload its trainer onto a device the leader's engine
has not released yet, or the leader resume weights or KV onto a device whose trainer still holds them.

A run starts in TRAIN with every engine released. Weights are pushed in SYNC,
right before the rollout that uses them, so a regroup between rounds only
chooses which engine set wakes up.

Every hand-off is a fixed list of actions; each is timed and put on the
rank's timeline. On CPU the engines' actions are cheap no-ops, while the
trainer's release and restore its memory as on GPU; all are called and logged,
so the CPU run exercises the GPU sequence.
Any transition not in the table is a bug and raises.
"""
from __future__ import annotations

import enum
import logging
import time
from typing import Callable, Protocol, Sequence

from rollpacker.metrics import Timeline
from rollpacker.rollout.engine import RolloutEngine

log = logging.getLogger(__name__)

WEIGHTS = ("weights",)
CACHE = ("kv_cache", "cuda_graph")


class Offloadable(Protocol):
    def offload_optimizer(self) -> None: ...
    def offload(self) -> None: ...
    def onload(self) -> None: ...


class Phase(enum.Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"
    SYNC = "sync"


class PhaseError(RuntimeError):
    pass


class PhaseMachine:
    def __init__(self, trainer: Offloadable, engines: Callable[[], Sequence[RolloutEngine]], timeline: Timeline,
                 barrier: Callable[[], None] = lambda: None):
        """``engines`` returns the engines this rank leads in the current layout (may change per round);
        ``barrier`` waits for the other ranks whose devices the current engine spans."""
        self.trainer, self.engines, self.timeline = trainer, engines, timeline
        self.phase = Phase.TRAIN
        self.seconds: dict[str, float] = {}
        self._table: dict[tuple[Phase, Phase], list[tuple[str, Callable[[], None]]]] = {
            (Phase.ROLLOUT, Phase.TRAIN): [("offload", lambda: self._engines("release_memory", WEIGHTS + CACHE)),
                                           ("barrier", barrier), ("onload", self.trainer.onload)],
            (Phase.TRAIN, Phase.SYNC): [("offload", self.trainer.offload_optimizer), ("barrier", barrier),
                                        ("onload", lambda: self._engines("resume_memory", WEIGHTS))],
            (Phase.SYNC, Phase.ROLLOUT): [("offload", self.trainer.offload), ("barrier", barrier),
                                          ("onload", lambda: self._engines("resume_memory", CACHE))],
        }

    def to(self, target: Phase) -> None:
        if target is self.phase:
            return
        actions = self._table.get((self.phase, target))
        if actions is None:
            raise PhaseError(f"no hand-off from {self.phase.value} to {target.value}")
        for name, action in actions:
            start = time.time()
            action()
            end = time.time()
            self.timeline.record(name, start, end)
            key = f"handoff/{self.phase.value}_to_{target.value}/{name}_s"
            self.seconds[key] = self.seconds.get(key, 0.0) + end - start
        log.debug("phase %s -> %s", self.phase.value, target.value)
        self.phase = target

    def pop_seconds(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out

    def _engines(self, method: str, tags: Sequence[str]) -> None:
        for engine in self.engines():
            getattr(engine, method)(list(tags))
