"""torchrun script: the program's control-plane collectives under a default group that refuses host tensors.

Usage: control_plane.py MODEL_DIR RUN_DIR. On GPU the default group is NCCL, which has no backend
for CPU tensors. Here it is initialised as ``cuda:gloo`` (gloo registered for CUDA tensors only), which
refuses a CPU tensor with NCCL's exact error, so every flag, object broadcast and endpoint exchange
the program makes must go over ``World.control``. Prints CONTROL_PLANE_OK on success.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from rollpacker.checkpoint import CheckpointManager
from rollpacker.control.transport import exchange_endpoints
from rollpacker.metrics import Timeline
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.qwen_torch import iter_safetensors
from rollpacker.runtime.engines import EngineSets
from rollpacker.runtime.rollout_phase import broadcast_groups
from rollpacker.runtime.streaming import replica_of_ranks
from rollpacker.runtime.world import World
from rollpacker.reward import RewardConfig
from rollpacker.reward.service import NodeReward
from rollpacker.sample import Prompt, Sample, SampleGroup
from rollpacker.scheduler.round import EngineLayout


def main(model_dir: str, run_dir: str) -> None:
    dist.init_process_group("cuda:gloo")
    try:  # the premise: host tensors on the device group fail as they do on NCCL
        dist.all_reduce(torch.ones(1))
        raise AssertionError("the default group accepted a CPU tensor; the test would prove nothing")
    except RuntimeError as exc:
        assert "No backend type associated with device type cpu" in str(exc), exc
    world = World.init()
    rank = world.rank
    assert dist.get_backend(world.control) == "gloo"

    ckpt = CheckpointManager(run_dir, group=world.control)
    assert not ckpt.any_stop_requested()
    ckpt.stop_requested = rank == 1  # SIGTERM reached one rank only
    assert ckpt.any_stop_requested()

    world.build_rollout_layouts([1])
    engines = EngineSets(world, RolloutConfig(kv_cache_tokens=256), model_dir, [EngineLayout(1)])
    engines.active.resume_memory(["weights"])  # what the phase machine does before a sync
    engines.push(iter_safetensors(model_dir))
    assert engines.max_weight_diff(iter_safetensors(model_dir)) == 0.0  # run.verify_sync

    timeline = Timeline(rank)
    timeline.record("train", 0.0, 1.0)
    spans = timeline.gather(world.control)
    assert len(spans) == (2 if rank == 0 else 0)
    prompt = Prompt(uid=7, input_ids=[1], data_source="math")
    group = SampleGroup(prompt, [Sample(prompt, 0, [2], [-0.5])])
    got = broadcast_groups([group] if rank == 0 else None, world.control)
    assert [(s.prompt.uid, list(s.response_ids)) for g in got for s in g] == [(7, [2])]
    # two nodes of one rank: a pool each, which share what they learned of the code tests' runtimes
    nodes = NodeReward(RewardConfig(num_workers=1), tokenizer=None, lead=rank, local_size=1, group=world.control)
    pool = nodes.pool
    pool.code_timeouts.observe(f"p{rank}", {0: 1.5 + rank})
    nodes.share_code_timeouts()
    assert [pool.code_timeouts.anchor(f"p{r}", 0) for r in (0, 1)] == [1.5, 2.5]
    nodes.load_everywhere({"code_timeouts": {"anchors": {"p9#0": 4.0}}} if rank == 0 else None)
    assert pool.code_timeouts.state_dict() == {"anchors": {"p9#0": 4.0}}
    nodes.close()
    assert replica_of_ranks(rank, world.control) == [0, 1]
    assert len(exchange_endpoints(1000 + rank, 2000 + rank, group=world.control)) == 2
    engines.shutdown()
    print("CONTROL_PLANE_OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
