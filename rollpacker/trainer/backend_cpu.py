"""CPU backend: the Megatron model with a plain micro-batch loop and torch AdamW.

Megatron's schedules and optimizers allocate CUDA buffers (PLATFORM.md), so
this backend replaces exactly those two pieces and keeps the rest: the same
``GPTModel`` shard, the same loss, the same normalisation. Its AdamW is
configured the way ``get_megatron_optimizer`` configures Adam — decoupled
weight decay, none on biases and 1-D parameters, clipping by the global norm
with Megatron's ``max_norm / (norm + 1e-6)`` coefficient — so that a
hyper-parameter means the same thing on both backends.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.parallel import ParallelLayout
from megatron_ext.routing import replayed
from rollpacker.trainer.backend import Backend, LossFn, StepResult, global_grad_norm, state_tensors
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.packing import MicroBatch


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.dim() == 1 or name.endswith(".bias")


def _is_tp_duplicate(param: torch.nn.Parameter, layout: ParallelLayout) -> bool:
    return not getattr(param, "tensor_model_parallel", False) and layout.tp_rank != 0


class CpuBackend(Backend):
    micro_batch_layout = "padded"
    pad_multiple = 1

    def __init__(self, model: torch.nn.Module, layout: ParallelLayout, cfg: TrainerConfig):
        if layout.pp > 1 or layout.cp > 1:
            raise ValueError(f"the CPU backend runs tensor and data parallelism only; got trainer.pp={layout.pp}, "
                             f"trainer.cp={layout.cp} (set both to 1 on CPU)")
        if cfg.params_dtype != "fp32":
            raise ValueError(f"trainer.params_dtype={cfg.params_dtype!r}: the CPU backend keeps no fp32 master "
                             "weights, so it trains in fp32 only; set trainer.params_dtype=fp32")
        super().__init__(model, layout, cfg)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        groups = [
            {"params": [p for n, p in named if not _no_weight_decay(n, p)], "weight_decay": cfg.weight_decay},
            {"params": [p for n, p in named if _no_weight_decay(n, p)], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           eps=cfg.adam_eps)
        self._duplicate = [_is_tp_duplicate(p, layout) for p in self._params]
        # experts split over expert parallelism (megatron marks them allreduce=False): each EP rank
        # holds different ones, whose replicas are the expert-data-parallel group
        self._expert = [not getattr(p, "allreduce", True) for p in self._params]
        # Qwen3's q/k norms are replicated over TP but each rank's gradient covers only its own heads,
        # and under sequence parallelism every replicated parameter's covers only its rank's positions:
        # summed over TP, as megatron-core's finalize_model_grads does on the GPU backend.
        self._tp_summed = [p for n, p in named if "q_layernorm" in n or "k_layernorm" in n
                           or getattr(p, "sequence_parallel", False)]

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *,
                         forward_only: bool = False) -> list[Any]:
        results = []
        self.model.train(not forward_only)
        moe = self.spec.is_moe
        for mb in micro_batches:
            with torch.set_grad_enabled(not forward_only), replayed(self.model, mb.routing):
                # right padding + causal attention: no real token attends to padding; a MoE router
                # leaves padding out of its load-balancing loss
                logits = self.model(mb.input_ids, mb.position_ids, attention_mask=None,
                                    **({"padding_mask": ~mb.real} if moe else {}))
                loss, result = loss_fn(mb, logits)
                if not forward_only:
                    loss.backward()
            results.append(result)
        return results

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()

    def reduce_grads(self, scale: float) -> None:
        if self.layout.tp > 1:
            for p in self._tp_summed:
                dist.all_reduce(p.grad, group=self.layout.tp_group)
        for expert, group in ((False, self.layout.dp_group), (True, self.layout.expert_dp_group)):
            params = [p for p, e in zip(self._params, self._expert) if e == expert]
            if not params:
                continue
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            if group is not None and group.size() > 1:
                dist.all_reduce(flat, group=group)
            flat.mul_(scale)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    @torch.no_grad()
    def step(self) -> StepResult:
        norm = global_grad_norm([p.grad for p in self._params], self._duplicate, self.layout, self._expert)
        if not torch.isfinite(torch.tensor(norm)):
            return StepResult(applied=False, grad_norm=norm)
        coeff = self.cfg.grad_clip / (norm + 1e-6)
        if self.cfg.grad_clip > 0 and coeff < 1.0:
            for p in self._params:
                p.grad.mul_(coeff)
        self.optimizer.step()
        return StepResult(applied=True, grad_norm=norm)

    def optimizer_state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        # AdamW keeps the loaded tensors as they are, and torch.load's storages belong to the
        # checkpoint's buffer: they cannot be resized, which offload needs. Own copies can.
        for s in self.optimizer.state.values():
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    s[k] = v.clone()

    def _device_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        return (list(self.model.parameters()), state_tensors(self.optimizer),
                [p.grad for p in self._params if p.grad is not None])
