"""The training side's Megatron process-group layout (TP x CP x DP x PP, and EP for experts).

This is the only module that touches Megatron's ``parallel_state`` globals:
:func:`setup_layout` initialises them and returns a :class:`ParallelLayout` that
carries the groups explicitly, so everything downstream passes groups instead
of reading globals. The rollout side has its own groups and never calls this.
"""
from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext import cpu_compat


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    cp: int
    dp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup  # replicas of the same model shard, excluding CP
    pg_collection: ProcessGroupCollection  # what GPTModel is built with
    device: torch.device
    owns_default_group: bool  # a world of one created by setup_layout: teardown destroys it
    # Expert parallelism: the ep ranks that hold different experts of one sparse layer, and the
    # ranks that hold the same experts (the experts' data parallelism: world / (ep * tp * pp)).
    ep: int = 1
    ep_rank: int = 0
    ep_group: dist.ProcessGroup | None = None
    expert_dp_group: dist.ProcessGroup | None = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_writer(self) -> bool:
        """The one rank of the job that writes shared files (checkpoints, configs)."""
        return dist.get_rank() == 0


def _init_default_group() -> bool:
    """Initialise the default group if needed; True if it is a world of one that teardown may destroy."""
    if dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:  # a plain single process: a world of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return True
    # Under torchrun the default group cannot be re-created after destruction (the rendezvous
    # store is single-use), so it lives until the process exits and later layouts reuse it.
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return False


def setup_layout(tp: int = 1, pp: int = 1, cp: int = 1, *, ep: int = 1, seed: int = 1234) -> ParallelLayout:
    """Initialise Megatron's groups for (tp, pp, cp); DP takes the remaining ranks. ``ep``: expert
    parallelism for mixture-of-experts models (its experts split over tp as dense layers are).

    Initialises the default process group when the caller has not (gloo on CPU,
    nccl on GPU; a world of one outside torchrun), and seeds Megatron's RNG
    streams so that weight init and dropout are reproducible.
    """
    cpu_compat.apply()
    owns = _init_default_group()
    world = dist.get_world_size()
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if size < 1:
            raise ValueError(f"setup_layout: {name} must be >= 1, got {size}")
    if world % (tp * pp * cp):
        raise ValueError(f"setup_layout: tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp} does not divide "
                         f"the world size {world}; launch a multiple of {tp * pp * cp} ranks")
    if world % (tp * pp * ep):
        raise ValueError(f"setup_layout: tp*pp*ep = {tp}*{pp}*{ep} = {tp * pp * ep} does not divide the world "
                         f"size {world}; choose an ep that divides {world // (tp * pp)}")
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("setup_layout: a Megatron layout is already initialised; call teardown_layout first")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    ps = parallel_state
    return ParallelLayout(
        tp=tp, pp=pp, cp=cp, dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(), dp_group=ps.get_data_parallel_group(),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"),
        owns_default_group=owns, ep=ep, ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(), expert_dp_group=ps.get_expert_data_parallel_group())


def teardown_layout(layout: ParallelLayout) -> None:
    """Destroy Megatron's groups, and the default group if it is a world of one made by setup_layout."""
    parallel_state.destroy_model_parallel()
    if layout.owns_default_group:
        dist.destroy_process_group()
