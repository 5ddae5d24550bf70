"""Rollout engines: one interface (``engine``), a PyTorch reference engine, an SGLang backend."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import RolloutEngine

if TYPE_CHECKING:
    import torch.distributed as dist


def make_engine(cfg: RolloutConfig, model_dir: str | Path, *, group: dist.ProcessGroup | None = None,
                engine_id: int = 0, device: str = "cpu", sglang_engine_cls: Callable | None = None) -> RolloutEngine:
    """Build the engine ``cfg.backend`` names, on every rank of ``group`` (None: this rank alone).

    ``sglang_engine_cls`` replaces ``sglang.Engine`` (tests inject a recording double);
    sglang itself is imported only when that backend is selected and no double is given.
    """
    if cfg.backend == "reference":
        from rollpacker.rollout.reference import ReferenceEngine
        return ReferenceEngine(model_dir, cfg, group=group, engine_id=engine_id, device=device)
    if cfg.backend == "sglang":
        from rollpacker.rollout.sglang_backend import SGLangEngine
        return SGLangEngine(model_dir, cfg, group=group, engine_id=engine_id, device=device,
                            engine_cls=sglang_engine_cls)
    raise ValueError(f"unknown rollout backend {cfg.backend!r}; choose 'reference' or 'sglang'")


__all__ = ["make_engine", "RolloutConfig", "RolloutEngine"]
