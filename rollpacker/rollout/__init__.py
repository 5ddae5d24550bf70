"""Rollout engines: one interface (``engine``), a PyTorch reference engine, an SGLang backend."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import RolloutEngine

if TYPE_CHECKING:
    import torch.distributed as dist


_SGLANG_DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16"}


def make_engine(cfg: RolloutConfig, model_dir: str | Path, *, group: dist.ProcessGroup | None = None,
                engine_id: int = 0, device: str = "cpu", sglang_host: Callable | None = None,
                window: int | None = None, ep: int = 1) -> RolloutEngine:
    """Build the engine ``cfg.backend`` names, on every rank of ``group`` (None: this rank alone), a MoE
    model's experts split into ``ep`` blocks over the group's ranks.

    ``window``: the run's longest sequence (prompt + response), which ``cfg.match_trainer`` computes at.

    ``sglang_host``: what runs the SGLang engine's driver (``SGLangEngine``'s ``host``); sglang
    itself is imported only by the engine's host process.
    """
    engine: RolloutEngine
    if cfg.match_trainer:
        if group is not None and group.size() > 1 or window is None:
            raise ValueError("rollout.match_trainer runs one engine per rank (rollout TP 1) at a given window")
        from rollpacker.rollout.matched import MatchedEngine
        engine = MatchedEngine(model_dir, cfg, window=window, engine_id=engine_id, device=device)
    elif cfg.backend == "reference":
        import torch

        from rollpacker.rollout.reference import ReferenceEngine
        engine = ReferenceEngine(model_dir, cfg, group=group, engine_id=engine_id, device=device,
                                 dtype=torch.bfloat16 if cfg.dtype == "bf16" else torch.float32, ep=ep)
    elif cfg.backend == "sglang":
        from rollpacker.rollout.sglang_backend import SGLangEngine
        engine = SGLangEngine(model_dir, cfg, group=group, engine_id=engine_id, device=device, host=sglang_host,
                              dtype=_SGLANG_DTYPES[cfg.dtype], ep=ep)
    else:
        raise ValueError(f"unknown rollout backend {cfg.backend!r}; choose 'reference' or 'sglang'")
    if cfg.length_replay.enabled:
        from rollpacker.rollout.replay import LengthReplay, ReplayLengths
        engine = LengthReplay(engine, ReplayLengths(cfg.length_replay, cfg.max_response_length))
    return engine


__all__ = ["make_engine", "RolloutConfig", "RolloutEngine"]
