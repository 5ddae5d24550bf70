"""This rank's rollout engines: one per layout (TP size, and EP size for a MoE model) the planner
may choose, one set awake.

Regrouping between rounds is a switch of engine set: every rank belongs to
exactly one engine group of each TP size (``World.rollout``), and builds an
engine over it for each EP size the planner may pick at that TP. All sets are
released while the trainer runs; before a round the program selects the set of
the round's layout, and the phase machine wakes it (weights, then KV cache)
while the current weights are pushed into it. Control-plane calls (release,
resume, weight loads) are made by every rank of an engine together; only the
decode loop is leader-driven.
"""
from __future__ import annotations

from typing import Iterator

import time

import torch
import torch.distributed as dist

from rollpacker.rollout import make_engine
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import MEMORY_TAGS, RolloutEngine
from rollpacker.runtime.world import RolloutLayout, World
from rollpacker.scheduler.round import EngineLayout


class EngineSets:
    def __init__(self, world: World, cfg: RolloutConfig, model_dir: str, choices: list[EngineLayout], *,
                 window: int | None = None):
        """Collective: build this rank's engine of every layout in ``choices``, then release them all.
        ``window``: the fixed width ``rollout.match_trainer`` computes at."""
        self.world = world
        self.engines: dict[EngineLayout, RolloutEngine] = {}
        for choice in sorted(set(choices)):
            layout = world.rollout[choice.tp]
            engine = make_engine(cfg, model_dir, group=layout.group, engine_id=layout.engine_id,
                                 device=str(world.device), window=window, ep=choice.ep)
            engine.release_memory(list(MEMORY_TAGS))
            self.engines[choice] = engine
        self.choice = min(self.engines)

    @property
    def tp_sizes(self) -> set[int]:
        return {choice.tp for choice in self.engines}

    @property
    def layout(self) -> RolloutLayout:
        """The process groups of the awake set's TP size."""
        return self.world.rollout[self.choice.tp]

    @property
    def active(self) -> RolloutEngine:
        return self.engines[self.choice]

    def awake(self) -> list[RolloutEngine]:
        """The engine the phase machine resumes and releases: this rank's one in the current layout."""
        return [self.active]

    def device_barrier(self) -> None:
        """Wait for the other ranks of the awake engine: they share the devices whose engine memory its
        leader releases and resumes (the phase machine's ``barrier``)."""
        if self.layout.control is not None:
            dist.barrier(group=self.layout.control)

    def select(self, choice: EngineLayout) -> None:
        """Choose the set for the next round; only while every set is released (TRAIN phase)."""
        if choice not in self.engines:
            raise ValueError(f"no rollout engines of {choice}; built: {', '.join(map(str, sorted(self.engines)))}")
        self.choice = choice

    def push(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Collective: stream the trainer's full tensors into the awake engine.

        Every rank walks the stream (the trainer's gather over TP/PP is
        collective); a reference engine keeps each rank's shard, an SGLang
        engine's owner pushes buckets and its other ranks only walk.
        """
        start, nbytes = time.perf_counter(), 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal nbytes
            for name, tensor in named_tensors:
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.active.update_weights(counted())
        return {"sync/bytes": float(nbytes), "sync/load_s": time.perf_counter() - start}

    def max_weight_diff(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> float:
        """Collective: the largest |engine weight - trainer weight| over every rank's shards."""
        diff = torch.tensor([self.active.max_weight_diff(named_tensors)], dtype=torch.float64)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=self.world.control)
        return float(diff.item())

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()
