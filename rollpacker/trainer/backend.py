"""What a training backend must provide, and the parts every backend shares.

A backend owns one rank's Megatron model shard, its gradients and its
optimizer. The trainer drives it in one fixed pattern per optimizer step::

    zero_grad()
    forward_backward(micro_batches, loss_fn)   # any number of times; no DP traffic
    reduce_grads(scale)                        # DP sum, then * scale (1 / global count)
    step()                                     # clip, skip on NaN/Inf, update

Only two things differ between backends: how micro-batches are scheduled
(Megatron's pipeline schedules on GPU, a plain loop on CPU) and which
optimizer holds the state (Megatron's distributed optimizer on GPU, torch
AdamW on CPU). The loss (:func:`micro_batch_loss`), the micro-batch layout,
the normalisation and the stream accounting live outside the backends.

Between phases the trainer gives its device memory to the rollout engine
(:meth:`Backend.offload`, :meth:`Backend.onload`), the same way on every
device: see :class:`StorageOffload`.
"""
from __future__ import annotations

import abc
import contextlib
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megatron_ext.logprobs import token_logprobs
from megatron_ext.parallel import ParallelLayout
from megatron_ext.weights import unwrap
from rollpacker.hf_spec import ModelSpec
from rollpacker.trainer import mismatch
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.grpo import LossSums, grpo_token_loss
from rollpacker.trainer.packing import Layout, MicroBatch, filler_micro_batch, pad_micro_batch

# (micro-batch, logits of its last stage) -> (scalar to differentiate, detached result)
LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, Any]]


@dataclass(frozen=True)
class Moved:
    """What an offload released from the device, or an onload put back."""
    bytes: int
    seconds: float


class StorageOffload:
    """Releases the storage under a set of tensors and later restores it in place.

    Storages, not tensors, are moved: every view of a buffer goes and comes back with it (on GPU the
    params and main grads are views of DDP's flat buffers, and the distributed optimizer's fp32 shards
    of fp32 params views of the param buffer), and every tensor object stays the one its owners hold.
    A released storage has size 0, so its memory is free; touching its tensors before the restore is
    a bug (on CPU it reads a null pointer). Kept storages are copied to host first and come back
    bit-identical; dropped ones come back zero-filled. On CPU the host is the device: only the
    dropped bytes are gained, and the same path runs so that CPU runs exercise the GPU one.
    Releases may come in stages (the optimizer's state, then the params): one restore brings back
    everything released since the last.
    """

    def __init__(self, device: torch.device):
        # Pinned copies are kept for the next offload (pinning costs more than the copy); plain ones
        # are not, as they would double a CPU trainer's memory while it trains.
        self._pin = device.type == "cuda"
        self._host: list[torch.Tensor] = []
        self._released: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] | None = None
        self._kept = 0  # host copies made since the last restore (this cycle's index into _host)

    def release(self, keep: list[torch.Tensor], drop: list[torch.Tensor],
                spare: list[torch.Tensor] = ()) -> int:
        """Release the storages of ``keep`` (after a host copy) and of ``drop``, except those under
        ``spare`` and those released already; returns the bytes freed."""
        spared = _distinct_storages(list(spare))
        kept = {ptr: s for ptr, s in _distinct_storages(keep).items() if ptr not in spared}
        dropped = {ptr: s for ptr, s in _distinct_storages(drop).items() if ptr not in kept and ptr not in spared}
        if self._released is not None and not kept and not dropped:
            raise RuntimeError("offload() twice without an onload() between")
        fixed = [s for s in (*kept.values(), *dropped.values()) if not s.resizable()]
        if fixed:  # refused before anything is touched, so the trainer stays whole
            raise RuntimeError(f"offload: {len(fixed)} storage(s) of the trainer's state cannot be resized (e.g. "
                               "tensors still owned by torch.load's buffer); copy them when they are loaded")
        released = []
        for storage in kept.values():
            n, i = storage.nbytes(), self._kept
            reuse = i < len(self._host) and self._host[i].numel() == n
            host = self._host[i] if reuse else torch.empty(n, dtype=torch.uint8, pin_memory=self._pin)
            host.untyped_storage().copy_(storage, non_blocking=True)
            released.append((storage, n, host))
            self._host[i:i + 1] = [host]
            self._kept += 1
        released += [(storage, storage.nbytes(), None) for storage in dropped.values()]
        for storage, _, _ in released:
            storage.resize_(0)
        self._released = (self._released or []) + released
        return sum(n for _, n, _ in released)

    def restore(self) -> int:
        """Give every released storage its size back and its bytes (zeros if dropped); returns the bytes."""
        if self._released is None:
            raise RuntimeError("onload() without an offload() before it")
        for storage, n, host in self._released:
            storage.resize_(n)
            if host is None:
                storage.fill_(0)
            else:
                storage.copy_(host.untyped_storage(), non_blocking=True)
        restored, self._released = sum(n for _, n, _ in self._released), None
        del self._host[self._kept:]  # copies a shorter cycle no longer uses
        self._kept = 0
        if not self._pin:
            self._host = []
        return restored


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of a torch optimizer's per-parameter state (Adam's moments and step counters)."""
    return [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def _distinct_storages(tensors: list[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """Each non-empty storage under ``tensors`` once, by address (views of one buffer share it)."""
    storages = (t.untyped_storage() for t in tensors)
    return {s.data_ptr(): s for s in storages if s.nbytes() > 0}


@dataclass(frozen=True)
class StepResult:
    applied: bool  # False: NaN/Inf found, weights and optimizer state left as they were
    grad_norm: float  # global L2 norm before clipping (NaN/Inf when the step was skipped)


def micro_batch_loss(mb: MicroBatch, logits: torch.Tensor, *, cfg: TrainerConfig, tp_group: dist.ProcessGroup,
                     vocab_size: int, cp_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, LossSums]:
    """GRPO loss of one micro-batch from its vocab-parallel logits ``[b, s, V/tp]``: see ``policy_loss``."""
    logprobs, entropy = token_logprobs(logits, mb.labels, tp_group, vocab_size=vocab_size, with_entropy=True)
    return policy_loss(mb, logprobs, entropy, cfg=cfg, cp_group=cp_group)


def policy_loss(mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None = None, *,
                cfg: TrainerConfig, cp_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, LossSums]:
    """GRPO loss of one micro-batch from the trainer's log-probs of its tokens, with the engine-trainer
    gap measured and, if configured, corrected. ``cp_group``: the context-parallel group whose ranks
    hold the other parts of these sequences (None: this rank holds them whole)."""
    # recompute: the behaviour policy is the current weights (one optimizer step per batch), so its
    # log-probs are this forward's own, detached (old=None); a second forward would give the same numbers.
    old = None
    if cfg.old_logprobs == "engine":
        missing = (mb.loss_mask > 0) & torch.isnan(mb.rollout_logprobs)
        if bool(missing.any()):
            raise ValueError("trainer.old_logprobs=engine, but some response tokens have no rollout log-prob; "
                             "use old_logprobs=recompute or make the engine return log-probs")
        old = torch.nan_to_num(mb.rollout_logprobs, nan=0.0)
    reduce = None if cp_group is None else partial(_all_reduced, group=cp_group)
    gap = mismatch.measure(logprobs, mb.rollout_logprobs, loss_mask=mb.loss_mask, sequence_index=mb.sequence_index,
                           sequence_starts=mb.sequence_starts, num_sequences=mb.num_sequences, reduce=reduce)
    loss_mask, weights, starts, is_weights = mb.loss_mask, mb.weights, mb.sequence_starts, None
    if cfg.mismatch.correct != "off":
        fix = mismatch.correct(gap, cfg.mismatch)
        kept_len, starts = mismatch.kept_responses(gap, fix.keep)
        loss_mask, is_weights, starts = (t.reshape(mb.loss_mask.shape) for t in (fix.keep, fix.weights, starts))
        if cfg.loss_aggregation == "seq_mean":  # a response's rejected tokens leave its length too
            weights = (1.0 / kept_len.clamp(min=1.0)).reshape(mb.weights.shape)
    sums = grpo_token_loss(
        logprobs, advantages=mb.advantages, loss_mask=loss_mask, weights=weights,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_ratio_c=cfg.clip_ratio_c, old_logprobs=old,
        ref_logprobs=mb.ref_logprobs, kl_coef=cfg.kl_coef, entropy=entropy, sequence_starts=starts,
        is_weights=is_weights)
    sums.logprob_mismatch, sums.logprob_mismatch_max, sums.mismatch_tokens = mismatch.sync_check(gap)
    sums.mismatch = mismatch.diagnostics(gap, cfg.mismatch)
    return sums.objective, sums.detached()


def _all_reduced(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


def logprobs_only(mb: MicroBatch, logits: torch.Tensor, *, tp_group: dist.ProcessGroup,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-prob of the label (the reference policy's), for a forward-only pass."""
    logprobs = token_logprobs(logits, mb.labels, tp_group, vocab_size=vocab_size).detach()
    return torch.zeros((), device=logits.device), logprobs


class Backend(abc.ABC):
    """One rank's model shard + gradients + optimizer (see the module docstring)."""

    layout: ParallelLayout
    model: torch.nn.Module  # the unwrapped GPTModel shard (HF conversion reads it)
    micro_batch_layout: Layout
    pad_multiple: int

    def __init__(self, model: torch.nn.Module, layout: ParallelLayout, cfg: TrainerConfig):
        self.model, self.layout, self.cfg = model, layout, cfg
        self._offload = StorageOffload(layout.device)

    @property
    def spec(self) -> ModelSpec:
        """The architecture of the HF checkpoint the model was built from."""
        return unwrap(self.model).hf_spec

    @property
    def vocab_size(self) -> int:
        """The real (HF) vocabulary; the model's output layer is padded beyond it."""
        return self.spec.vocab_size

    @abc.abstractmethod
    def forward_backward(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *,
                         forward_only: bool = False) -> list[Any]:
        """Run ``loss_fn`` on every micro-batch (backward too unless ``forward_only``),
        accumulating gradients locally. Returns the detached results on the last
        pipeline stage, an empty list elsewhere."""

    def conform(self, micro_batches: list[MicroBatch]) -> list[MicroBatch]:
        """``micro_batches`` as the model runs them. Sequence parallelism splits a padded row's
        positions over TP: widths become a multiple of it. Every rank of an expert-parallel group
        runs each sparse layer's forward and backward together: they all run the same number of
        micro-batches (padding ones added), of one shape where the token dispatcher needs it (the
        padded layout's allgather)."""
        padded = self.micro_batch_layout == "padded"
        if padded and unwrap(self.model).config.sequence_parallel:
            tp = self.layout.tp
            micro_batches = [pad_micro_batch(mb, mb.input_ids.shape[0], -(-mb.input_ids.shape[1] // tp) * tp)
                             for mb in micro_batches]
        if self.layout.ep == 1:
            return micro_batches
        shapes = [tuple(mb.input_ids.shape) if padded else (1, mb.input_ids.shape[1]) for mb in micro_batches]
        agreed = torch.tensor([len(shapes), max((r for r, _ in shapes), default=1), max((w for _, w in shapes), default=1)],
                              dtype=torch.int64, device=self.layout.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.layout.ep_group)
        count, rows, width = (int(x) for x in agreed.tolist())
        if padded:
            micro_batches = [pad_micro_batch(mb, rows, width) for mb in micro_batches]
        else:  # the alltoall dispatcher takes any token counts: a filler only needs a valid sequence
            rows, width = 1, self.pad_multiple
        return micro_batches + [filler_micro_batch(self.micro_batch_layout, rows=rows, width=width)
                                for _ in range(count - len(micro_batches))]

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def reduce_grads(self, scale: float) -> None:
        """Sum gradients over the data-parallel replicas, then multiply them by ``scale``."""

    def set_lr(self, lr: float) -> None:
        """The rate of the next steps; a group's ``lr_mult`` (Megatron's, e.g. 0 for frozen params) scales it."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)

    @abc.abstractmethod
    def step(self) -> StepResult:
        """Clip to ``grad_clip`` and update, unless the global gradient norm is NaN/Inf."""

    @abc.abstractmethod
    def optimizer_state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def _device_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(params, optimizer, dropped): every tensor of the params (and the buffers they are views
        of), of the optimizer's state (main weights, moments), and the grads. Params and optimizer
        state survive an offload bit-identically; dropped ones (grads: dead once the step is taken,
        and every step starts by zeroing them) come back as zeros, as Megatron's
        ``_ParamAndGradBuffer.reload_from_cpu`` gives them back."""

    def offload_optimizer(self) -> Moved:
        """Release the optimizer's state and the grads, keeping the params, which the weight push
        reads: during a sync the engine's weights then share the device with the params alone."""
        params, optimizer, drop = self._on_device()
        return self._release(optimizer, drop, spare=params)

    def offload(self) -> Moved:
        """Release this rank's params, grads and optimizer state (what ``offload_optimizer`` left)
        from the device (kept ones wait on host) so that the rollout engine can use the memory."""
        params, optimizer, drop = self._on_device()
        return self._release(params + optimizer, drop)

    def _on_device(self) -> tuple[list[torch.Tensor], ...]:
        # Only what sits on the accelerator: e.g. torch Adam's step counters live on the host anyway.
        return tuple([t for t in tensors if t.device.type == self.layout.device.type]
                     for tensors in self._device_state())

    def _release(self, keep: list[torch.Tensor], drop: list[torch.Tensor], spare: list[torch.Tensor] = ()) -> Moved:
        t0 = time.perf_counter()
        freed = self._offload.release(keep, drop, spare)
        if self.layout.device.type == "cuda":
            torch.cuda.empty_cache()  # the caching allocator would keep the blocks from the engine
        return Moved(freed, self._since(t0))

    def onload(self) -> Moved:
        t0 = time.perf_counter()
        return Moved(self._offload.restore(), self._since(t0))

    def _since(self, t0: float) -> float:
        if self.layout.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def params_to_host(self) -> dict[str, torch.Tensor]:
        """A host copy of this rank's parameter shard, by Megatron parameter name."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def load_params(self, host: dict[str, torch.Tensor]) -> None:
        """Copy a shard from :meth:`params_to_host` into the model's parameters, in place."""
        params = dict(self.model.named_parameters())
        if params.keys() != host.keys():
            raise ValueError(f"parameter names differ: missing {sorted(params.keys() - host.keys())[:3]}, "
                             f"unexpected {sorted(host.keys() - params.keys())[:3]}")
        for name, p in params.items():
            p.copy_(host[name])

    def rng_state(self) -> dict[str, Any]:
        """Every RNG stream a step can draw from: torch's, the device's and Megatron's tracked ones."""
        state = {"cpu": torch.get_rng_state(), "megatron": tensor_parallel.get_cuda_rng_tracker().get_states()}
        if self.layout.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])
        if self.layout.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"])

    @contextlib.contextmanager
    def swapped_params(self, host: dict[str, torch.Tensor],
                       current: dict[str, torch.Tensor] | None = None) -> Iterator[None]:
        """Temporarily run with other weights (the reference policy) in the same model.

        The current weights come back bit-identical from ``current`` (their host
        copy, when the caller already holds one) or from a copy taken here, so
        no second model is ever resident on the device.
        """
        current = self.params_to_host() if current is None else current
        self.load_params(host)
        try:
            yield
        finally:
            self.load_params(current)


def global_grad_norm(grads: list[torch.Tensor], is_duplicate: list[bool], layout: ParallelLayout,
                     is_expert: list[bool] | None = None) -> float:
    """L2 norm of the full model's gradient from this rank's shard.

    Parameters replicated over TP (norms, biases of row-parallel layers) are
    counted on TP rank 0 only; the squares are summed over TP and PP, and an
    expert-parallel expert's (each held by one EP rank) also over EP.
    """
    dense, experts = (torch.zeros((), dtype=torch.float64, device=layout.device) for _ in range(2))
    for g, dup, expert in zip(grads, is_duplicate, is_expert or [False] * len(grads)):
        if not dup:
            (experts if expert else dense).add_(g.detach().double().pow(2).sum())
    if layout.ep > 1:
        dist.all_reduce(experts, group=layout.ep_group)
    total = dense + experts
    for group, size in ((layout.tp_group, layout.tp), (layout.pp_group, layout.pp)):
        if size > 1:
            dist.all_reduce(total, group=group)
    return float(total.sqrt())
