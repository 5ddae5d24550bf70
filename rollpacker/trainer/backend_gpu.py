"""GPU backend: Megatron DDP, the distributed optimizer and Megatron's pipeline schedules.

Written against megatron-core 0.16.1. Three settings make Megatron's machinery
compute exactly the trainer's sum-then-normalise objective (grpo.py):

* ``calculate_per_token_loss=True``: the schedules neither divide a
  micro-batch's loss by its token count nor by the number of micro-batches,
  and DDP sums (does not average) gradients over data-parallel replicas;
* ``finalize_model_grads_func=None`` with ``no_sync_func=ddp.no_sync`` and
  ``overlap_grad_reduce=False``: ``forward_backward_func`` only accumulates
  into the local gradient buffers, so any number of calls (one per streamed
  prompt group) can precede the single DP reduction in :meth:`reduce_grads`;
* ``variable_seq_lengths=True``: packed (THD) micro-batches differ in length,
  so pipeline stages exchange shapes before activations.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from functools import partial
from typing import Any, Iterator

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.utils import get_thd_batch_on_this_cp_rank

from megatron_ext.parallel import ParallelLayout
from megatron_ext.routing import replayed
from megatron_ext.sdpa_attention import set_packed_attention, uses_sdpa_attention
from rollpacker.trainer.backend import Backend, LossFn, StepResult, state_tensors
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.packing import TOKEN_FIELDS, MicroBatch


def cp_shard(mb: MicroBatch, cp: int, cp_rank: int) -> tuple[MicroBatch, PackedSeqParams]:
    """This context-parallel rank's tokens of a packed micro-batch, and its ``PackedSeqParams``.

    Megatron's THD helper cuts every (padded) sequence into ``2*cp`` chunks and
    gives rank r chunks r and 2*cp-1-r (load-balanced causal attention); with
    cp == 1 it keeps everything. Every per-token tensor is cut the same way,
    except ``ref_logprobs``: the KL reference pass computed them with this very
    cut (a forward-only pass over the same micro-batch on the same rank), so
    they are already this rank's.
    """
    fields = {name: getattr(mb, name) for name in TOKEN_FIELDS
              if name != "ref_logprobs" and getattr(mb, name) is not None}
    batch = {("tokens" if k == "input_ids" else k): v for k, v in fields.items()}
    batch, params = get_thd_batch_on_this_cp_rank(
        batch, mb.cu_seqlens_unpadded, mb.cu_seqlens, torch.tensor([mb.max_seqlen]), cp_size=cp, cp_rank=cp_rank)
    batch["input_ids"] = batch.pop("tokens")
    return dataclasses.replace(mb, **batch), params


def _host_param_state(optimizer: Any) -> dict:
    """``get_parameter_state_dp_reshardable`` returns live device tensors; copy them to host.

    Its loader skips entries flagged ``padding``, a flag only Megatron's
    dist-checkpoint path sets; every entry here is a real parameter.
    """
    state = optimizer.get_parameter_state_dp_reshardable()
    for key, per_dtype in state.items():
        if not isinstance(key, int):  # per_bucket_numel bookkeeping
            continue
        for buckets in per_dtype.values():
            for bucket in buckets:
                for entry in bucket:
                    for name, value in entry.items():
                        if isinstance(value, torch.Tensor):
                            entry[name] = value.detach().to("cpu", copy=True)
                    entry["padding"] = False
    return state


def schedule_groups(layout: ParallelLayout, config: Any) -> dict[str, Any]:
    """The process-group arguments of Megatron's schedule for this layout.

    The pipelined schedule of megatron-core 0.16.1 takes explicit groups only together with a
    ``p2p_communicator`` (schedules.py: "provide none or provide all the process groups");
    the no-pipelining one takes ``pg_collection`` alone.
    """
    if layout.pp == 1:
        return {"pg_collection": layout.pg_collection}
    return {"pg_collection": layout.pg_collection,
            "p2p_communicator": P2PCommunicator(pp_group=layout.pp_group, config=config)}


def _unshare_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own Adam ``step`` counter again.

    Without TE or Apex, megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict`` puts one
    tensor object in every parameter's state (``for s in state_dict_state.values(): s["step"] = step``),
    and torch's Adam increments each parameter's counter in place: after a resume the shared counter
    advanced once per parameter per step, so bias correction ran at step 1 + N*k (seen on H100: the
    resumed optimizer's state differed from the uninterrupted one's by exactly N - 1).
    """
    for state in optimizer.optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


class GpuBackend(Backend):
    micro_batch_layout = "thd"

    def __init__(self, model: torch.nn.Module, layout: ParallelLayout, cfg: TrainerConfig):
        super().__init__(model, layout, cfg)
        # context parallelism splits each sequence in 2 * cp chunks; sequence parallelism (MoE with TP)
        # splits the packed tokens over TP
        sequence_parallel = model.config.sequence_parallel
        self.pad_multiple = (2 * layout.cp if layout.cp > 1 else 1) * (layout.tp if sequence_parallel else 1)
        bf16 = cfg.params_dtype == "bf16"
        config = model.config
        config.calculate_per_token_loss = True
        config.variable_seq_lengths = True
        # Megatron's MLP reads this flag at every forward: its torch.compile'd SwiGLU (one kernel each way)
        # instead of silu and a multiply. Qwen's MLP is the bias-free gated SiLU that fusion takes.
        config.bias_activation_fusion = cfg.fused_swiglu
        set_packed_attention(model, cfg.packed_attention)
        self.ddp = DistributedDataParallel(
            config=config, module=model, pg_collection=layout.pg_collection,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True))
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
                            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
                            clip_grad=cfg.grad_clip, bf16=bf16,
                            params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            use_distributed_optimizer=True),
            [self.ddp], pg_collection=layout.pg_collection, use_gloo_process_groups=False)
        # Megatron's groups carry wd_mult (0 for biases and 1-D params); its LR scheduler
        # normally applies it each step. Weight decay is constant here, so apply it once; the
        # trainer sets the rate of every step (set_lr).
        for group in self.optimizer.param_groups:
            group["weight_decay"] = cfg.weight_decay * group.get("wd_mult", 1.0)
        self.set_lr(cfg.lr)
        config.grad_scale_func = self.optimizer.scale_loss
        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = None
        self._forward_backward_func = get_forward_backward_func(pp_size=layout.pp, vp_size=None)
        # Without Transformer Engine every reader of cu_seqlens wants them on the host: the packed core
        # attention (which reads the spans there and makes the varlen kernel's one device copy per
        # micro-batch), and Megatron's unfused THD RoPE, which calls .tolist() on them for the query and
        # the key of every layer (48 device syncs per forward of a 24-layer model, seen in an H100
        # profile). TE's fused kernels read them on the device.
        self._seqlens_device = torch.device("cpu") if uses_sdpa_attention(model) else None
        self._schedule_groups = schedule_groups(layout, config)

    def _forward_step(self, loss_fn: LossFn, data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        mb, params = cp_shard(next(data_iterator).to(self.layout.device, seqlens_device=self._seqlens_device),
                              self.layout.cp, self.layout.cp_rank)
        # routing replay: set for each micro-batch's forward and left set through its backward, which
        # the schedule runs before the next forward (recompute is refused with replay); cleared when
        # forward_backward returns
        self._replays.enter_context(replayed(self.model, mb.routing))
        output = model(mb.input_ids, mb.position_ids, attention_mask=None, packed_seq_params=params)

        def loss_func(logits: torch.Tensor):
            loss, result = loss_fn(mb, logits)
            tokens = torch.tensor(mb.num_tokens, dtype=torch.int, device=logits.device)
            return loss, tokens, {"result": result}

        return output, loss_func

    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *,
                         forward_only: bool = False) -> list[Any]:
        if not micro_batches:
            return []
        self.ddp.train(not forward_only)
        with contextlib.ExitStack() as self._replays:
            store = self._forward_backward_func(
                forward_step_func=partial(self._forward_step, loss_fn), data_iterator=iter(micro_batches),
                model=[self.ddp], num_microbatches=len(micro_batches),
                seq_length=max(mb.input_ids.shape[1] for mb in micro_batches), micro_batch_size=1,
                forward_only=forward_only, **self._schedule_groups)
        return [out["result"] for out in store] if self.layout.is_last_stage else []

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def reduce_grads(self, scale: float) -> None:
        # DP reduce-scatter (distributed optimizer), tied-embedding sync over PP, then the one scaling
        finalize_model_grads([self.ddp], num_tokens=None, pg_collection=self.layout.pg_collection)
        self.ddp.scale_gradients(scale)

    @torch.no_grad()
    def step(self) -> StepResult:
        # Megatron's bf16 step has no NaN guard (only fp16 loss scaling skips), so look first;
        # prepare_grads only copies model grads to the main-grad shards and may run twice.
        self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            return StepResult(applied=False, grad_norm=norm)
        applied, norm, _ = self.optimizer.step()
        # The step's activations and logits are freed now, but the caching allocator would keep
        # their blocks; the engines resume weights and KV into this memory right after (SYNC).
        torch.cuda.empty_cache()
        return StepResult(applied=bool(applied), grad_norm=float(norm))

    def optimizer_state_dict(self) -> dict[str, Any]:
        """Per-rank state (same layout on resume): the common part and this rank's DP shard of
        main params and Adam moments, copied to host."""
        return {"chained": [{"common": o.state_dict(), "param_state": _host_param_state(o)}
                            for o in self.optimizer.chained_optimizers]}

    @torch.no_grad()  # the main shards of fp32 params are views of leaves that require grad
    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        chained = self.optimizer.chained_optimizers
        if len(state["chained"]) != len(chained):
            raise ValueError(f"optimizer checkpoint has {len(state['chained'])} optimizers, the model {len(chained)}")
        for o, s in zip(chained, state["chained"]):
            o.load_state_dict(s["common"])
            _unshare_adam_steps(o)
            o.load_parameter_state_from_dp_reshardable(s["param_state"])

    def _device_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        # DDP's flat buffers hold every param and main grad (as views). The distributed optimizer
        # holds its fp32 main shards (of bf16 params: copies; of fp32 params, such as the local spec's
        # norms in a bf16 model: views of the param buffer, moved with it), their grads (views of the
        # grad buffer, or fp32 copies of bf16 grads) and the Adam moments.
        buffers = self.ddp.buffers + self.ddp.expert_parallel_buffers
        # The params themselves too: views of the param buffer (the same storage), or where DDP keeps no
        # param buffer (param_data None), storages of their own.
        params = [b.param_data for b in buffers if b.param_data is not None] + list(self.model.parameters())
        optimizer, drop = [], [b.grad_data for b in buffers]
        for o in self.optimizer.chained_optimizers:
            for group in o.optimizer.param_groups:
                optimizer += group["params"]  # the main weights (views of the param buffer stay with it)
                drop += [p.grad for p in group["params"] if p.grad is not None]
            optimizer += state_tensors(o.optimizer)
        return params, optimizer, drop
