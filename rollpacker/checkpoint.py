"""Atomic, resumable checkpoints for the SPMD job.

Layout of one checkpoint::

    RUN_DIR/checkpoints/step_00000010/
        rank00000.pt ... rankNNNNN.pt    each rank's own state (trainer shards, RNG)
        shared.pt                        rank 0's coordinator state (data cursor,
                                         long-prompt queue, planner, reward timeouts)
        hf/                              the policy as an HF directory, for evaluation
        COMPLETE                         written last; a directory without it is ignored

Every rank writes into ``step_XXXXXXXX.tmp``; after a barrier rank 0 writes
``COMPLETE`` and renames the directory into place, so a crash at any point
leaves the previous checkpoint intact and readable. Older checkpoints beyond
``keep`` are removed only after the new one is complete.
"""
from __future__ import annotations

import logging
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_PREFIX = "step_"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    def __init__(self, run_dir: str | Path, *, keep: int = 2, group: dist.ProcessGroup | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = max(1, keep)
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.stop_requested = False

    # --- discovery -------------------------------------------------------
    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.glob(f"{_PREFIX}*") if not p.name.endswith(".tmp") and (p / "COMPLETE").exists()]
        return sorted(int(p.name[len(_PREFIX):]) for p in done)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    # --- save / load -----------------------------------------------------
    def save(self, step: int, rank_state: dict[str, Any], shared_state: dict[str, Any] | None = None,
             export: Callable[[Path], None] | None = None, before_commit: Callable[[], None] | None = None) -> Path:
        """Collective over ``group``: every rank passes its own state; rank 0 also the shared state.

        ``export(dir)``, when given, is called on every rank to write more files into the
        checkpoint (the HF export of the policy) before it is marked complete.
        ``before_commit()``, when given, is called on every rank once every file is written and
        before the checkpoint is marked complete: a record of the step written there (the ledger,
        the metrics) is never missing from a run resumed from this checkpoint.
        """
        final, tmp = self.path(step), self.path(step).with_name(self.path(step).name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        _atomic_torch_save({**rank_state, "rng": rng_state()}, tmp / f"rank{self.rank:05d}.pt")
        if self.rank == 0:
            _atomic_torch_save(shared_state or {}, tmp / "shared.pt")
        if export is not None:
            export(tmp)
        self._barrier()
        if before_commit is not None:
            before_commit()
        if self.rank == 0:
            (tmp / "COMPLETE").write_text(f"{step}\n")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.path(old), ignore_errors=True)
            log.info("checkpoint step %d written to %s", step, final)
        self._barrier()
        return final

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load this rank's state (RNG restored) and the shared state for ``step``."""
        path = self.path(step)
        rank_file = path / f"rank{self.rank:05d}.pt"
        if not rank_file.exists():
            raise FileNotFoundError(f"checkpoint {path} has no state for rank {self.rank}: "
                                    "was it written with a different world size?")
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        set_rng_state(rank_state.pop("rng"))
        shared = torch.load(path / "shared.pt", map_location="cpu", weights_only=False)
        return rank_state, shared

    # --- preemption --------------------------------------------------------
    def install_sigterm_handler(self) -> None:
        """SIGTERM (Slurm preemption, scancel) asks for a checkpoint at the end of the step."""
        def _handler(signum, frame):
            log.warning("SIGTERM received: will checkpoint and exit after this step")
            self.stop_requested = True
        signal.signal(signal.SIGTERM, _handler)

    def any_stop_requested(self) -> bool:
        """True on every rank if any rank was asked to stop (collective)."""
        if not dist.is_initialized():
            return self.stop_requested
        flag = torch.tensor([int(self.stop_requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".part")
    torch.save(obj, tmp)
    os.replace(tmp, path)
