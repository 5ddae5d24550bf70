"""The SPMD job's process groups: one rollout layout per TP size, one training layout.

All groups are created once at start-up (every rank must take part in every
``new_group`` call) and switched between phases. A rollout layout of TP size
``t`` splits the ranks into consecutive blocks of ``t``; each block is one
engine led by its first rank, and a block never spans nodes. The rollout
layouts are plain ``torch.distributed`` groups held here and passed
explicitly; Megatron's ``parallel_state`` globals describe the training
layout only.

Two kinds of traffic, two kinds of group. Device tensors (gradients, weights,
activations) go over the default group and the groups derived from it (NCCL
on GPU). Control messages (stop flags, plans, object broadcasts, timelines)
are small host objects and go over ``World.control``, a gloo group over every
rank: NCCL refuses CPU tensors ("No backend type associated with device type
cpu"), and an idle NCCL wait would spin a kernel on the GPU and trip the NCCL
watchdog during a long round.

Every group is set up through one store, which must be this attempt's alone
when torchrun restarts the workers (``--max-restarts``): see
:func:`attempt_store`.
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# A long round keeps the ranks that do not coordinate waiting at the next control collective.
CONTROL_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class RolloutLayout:
    tp: int
    engine_id: int  # the engine this rank belongs to
    leader: int  # global rank of that engine's leader
    members: tuple[int, ...]  # global ranks of that engine, leader first
    group: dist.ProcessGroup | None  # the engine's TP group (None at tp=1)
    control: dist.ProcessGroup | None  # the same ranks over gloo, for host-side waits (None at tp=1)
    leaders: tuple[int, ...]  # leader rank of every engine, by engine id

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.leader

    def ranks_of(self, engine_id: int) -> range:
        """Global ranks of engine ``engine_id`` (a consecutive block led by its first rank)."""
        return range(self.leaders[engine_id], self.leaders[engine_id] + self.tp)


@dataclass
class World:
    rank: int
    size: int
    local_size: int  # ranks per node
    device: torch.device
    control: dist.ProcessGroup  # gloo over every rank: host-side flags and objects
    rollout: dict[int, RolloutLayout] = field(default_factory=dict)

    @property
    def node_lead(self) -> int:
        """The first rank of this rank's node (torchrun numbers a node's ranks consecutively)."""
        return self.rank - self.rank % self.local_size

    @classmethod
    def init(cls, threads_per_rank: int = 1) -> "World":
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            store, rank, size = next(dist.rendezvous("env://", timeout=CONTROL_TIMEOUT))
            dist.init_process_group(backend, store=attempt_store(store, os.environ), rank=rank, world_size=size,
                                    timeout=CONTROL_TIMEOUT)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            torch.set_num_threads(threads_per_rank)
            device = torch.device("cpu")
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        return cls(rank=dist.get_rank(), size=dist.get_world_size(), local_size=local_size, device=device,
                   control=control)

    def build_rollout_layouts(self, tp_sizes: set[int] | list[int]) -> None:
        """Collective: create the engine groups of every TP size the planner may choose."""
        for tp in sorted(set(tp_sizes)):
            if self.size % tp or self.local_size % tp:
                raise ValueError(f"rollout TP {tp} must divide the world size {self.size} and the ranks "
                                 f"per node {self.local_size} (a TP group never spans nodes)")
            blocks = [tuple(range(start, start + tp)) for start in range(0, self.size, tp)]
            mine = None
            for engine_id, block in enumerate(blocks):
                # every rank joins every new_group call
                group = dist.new_group(list(block)) if tp > 1 else None
                # Followers wait here for a whole round: over gloo, with an explicit timeout,
                # not in an NCCL kernel spinning on a GPU the engine uses, under NCCL's 10-minute watchdog.
                control = dist.new_group(list(block), backend="gloo", timeout=CONTROL_TIMEOUT) if tp > 1 else None
                if self.rank in block:
                    mine = (engine_id, block, group, control)
            engine_id, block, group, control = mine
            self.rollout[tp] = RolloutLayout(tp=tp, engine_id=engine_id, leader=block[0], members=block,
                                             group=group, control=control, leaders=tuple(b[0] for b in blocks))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def attempt_store(store: dist.Store, env: Mapping[str, str]) -> dist.Store:
    """``store`` (from the ``env://`` rendezvous), with keys of this restart attempt only.

    torchrun's agent hosts one TCPStore for the whole job (``TORCHELASTIC_USE_AGENT_STORE=True``) and
    hands it to the workers of every attempt unchanged, so a restarted worker finds the dead attempt's
    gloo addresses and NCCL unique ids under the keys it uses: reading a peer's before the peer's
    replacement rewrites it, gloo's ``connectFullMesh`` dials a dead process ("Connection refused")
    and the restart fails (pytorch/pytorch#135712). On one node, ``TORCHELASTIC_RESTART_COUNT`` names
    the attempt and prefixes the keys. Nodes count restarts each on their own (an agent that restarts
    healthy workers for another node's failure does not count it), so a multi-node job needs a store
    per attempt, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (rank 0 hosts a new one per rendezvous
    round; ``launch/train.sh`` sets it), and one that could restart on the shared store is refused.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return store  # no torchrun, or a store of this attempt's own
    if int(env.get("GROUP_WORLD_SIZE", "1")) > 1 and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise RuntimeError("torchrun --max-restarts on several nodes needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                           "in the launcher's environment (launch/train.sh sets it): on the agent's shared store "
                           "the nodes' restart counts can disagree and a restart would hang (pytorch/pytorch#135712)")
    return dist.PrefixStore(f"rollpacker/attempt_{env['TORCHELASTIC_RESTART_COUNT']}/", store)
