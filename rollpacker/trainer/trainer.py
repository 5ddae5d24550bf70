"""The training stage as the entry point sees it: one object per rank.

``Trainer`` builds this rank's Megatron Qwen2/Qwen3 shard from an HF directory over
an explicit layout, picks the backend for the device (GPU: Megatron DDP +
distributed optimizer + pipeline schedules; CPU: the project's micro-batch
loop + torch AdamW) and exposes the step in two shapes that share one code
path: ``train_step(groups)`` (everything at once) and ``stream`` (groups fed
while rollout is still running; see stream.py).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from megatron_ext.parallel import ParallelLayout
from megatron_ext.model import build_model
from megatron_ext.weights import iter_hf_tensors, load_hf_checkpoint, save_hf_checkpoint
from rollpacker.sample import Sample
from rollpacker.trainer.backend import Backend, Moved
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.stream import StreamTrainer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_backend(model: torch.nn.Module, layout: ParallelLayout, cfg: TrainerConfig) -> Backend:
    if layout.device.type == "cuda":
        from rollpacker.trainer.backend_gpu import GpuBackend
        return GpuBackend(model, layout, cfg)
    from rollpacker.trainer.backend_cpu import CpuBackend
    return CpuBackend(model, layout, cfg)


class Trainer:
    def __init__(self, cfg: TrainerConfig, model_dir: str | Path, layout: ParallelLayout, *,
                 row_width: int | None = None):
        """``row_width``: pad every micro-batch row to this many tokens (``rollout.match_trainer``:
        the engine's window, so that both compute at one shape); None: to the micro-batch's longest."""
        if (cfg.tp, cfg.pp, cfg.cp, cfg.ep) != (layout.tp, layout.pp, layout.cp, layout.ep):
            raise ValueError(f"trainer.tp/pp/cp/ep = {cfg.tp}/{cfg.pp}/{cfg.cp}/{cfg.ep} but the layout was set up "
                             f"as {layout.tp}/{layout.pp}/{layout.cp}/{layout.ep}; build the layout from the trainer "
                             "config")
        self.cfg, self.layout, self.model_dir = cfg, layout, Path(model_dir)
        self.model = build_model(self.model_dir, params_dtype=_DTYPES[cfg.params_dtype],
                                 pre_process=layout.is_first_stage, post_process=layout.is_last_stage,
                                 pg_collection=layout.pg_collection, recompute=cfg.recompute,
                                 aux_loss_coef=cfg.moe_aux_loss_coef,
                                 routing_replay=cfg.routing_replay).to(layout.device)
        load_hf_checkpoint(self.model, self.model_dir)
        self.backend = make_backend(self.model, layout, cfg)
        if row_width is not None and self.backend.micro_batch_layout != "padded":
            raise ValueError(f"rollout.match_trainer needs the CPU trainer's padded micro-batches; the "
                             f"{layout.device.type} backend packs sequences ({self.backend.micro_batch_layout})")
        # The KL reference is the initial policy, kept on host and swapped in for its forward passes.
        reference = self.backend.params_to_host() if cfg.kl_coef > 0 else None
        self.stream = StreamTrainer(self.backend, cfg, reference=reference, row_width=row_width)
        self.steps = 0

    def train_step(self, groups: Sequence[Sequence[Sample]]) -> dict[str, float]:
        """One non-streamed step on ``groups`` (the same list on every rank)."""
        self.stream.begin()
        return self.finish_step(groups)

    def begin_step(self) -> None:
        """Start the step's gradient accumulation, unless a stream hand-off already started it."""
        if not self.stream.is_open:
            self.stream.begin()

    def finish_step(self, remaining: Sequence[Sequence[Sample]], *, fixed: bool = False) -> dict[str, float]:
        """End a streamed step (after ``stream.begin()`` / ``stream.consume(...)``); see StreamTrainer.finish."""
        lr = self.cfg.lr_at(self.steps + 1)
        self.backend.set_lr(lr)
        metrics = self.stream.finish(remaining, fixed=fixed)
        metrics["lr"] = lr
        self.steps += 1 - metrics["skipped"]
        return metrics

    # -- phases and weights ---------------------------------------------------------------------------

    def offload_optimizer(self) -> Moved:
        """Release the optimizer's state and the grads before a sync (see ``Backend.offload_optimizer``);
        the params stay for the weight push."""
        return self.backend.offload_optimizer()

    def offload(self) -> Moved:
        """Release params, grads and optimizer state from the device before rollout (see
        ``Backend.offload``); nothing may touch the model until ``onload``."""
        return self.backend.offload()

    def onload(self) -> Moved:
        """Params and optimizer state back bit-identical, grads as zeros."""
        return self.backend.onload()

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors for weight sync (collective over TP and PP)."""
        return iter_hf_tensors(self.model, self.layout)

    def save_hf(self, out_dir: str | Path) -> None:
        save_hf_checkpoint(self.model, self.layout, out_dir, self.model_dir)

    # -- exact resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's model shard, optimizer state, RNG streams and step count."""
        return {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()
                          if isinstance(v, torch.Tensor)},
                "optimizer": copy.deepcopy(self.backend.optimizer_state_dict()), "rng": self.backend.rng_state(), "steps": self.steps,
                "reference": self.stream.reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]  # not saved: not tensors
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        self.backend.load_optimizer_state_dict(state["optimizer"])
        self.backend.load_rng_state(state["rng"])
        self.stream.reference = state["reference"]
        self.steps = state["steps"]
