"""torchrun restarts the workers (``--max-restarts``) and they build their process groups again.

The training program's restart inside a Slurm job, resumed from its checkpoint with the ledger
checked, is ``tests/integration/test_slurm_launch.py``; ``launch/train.sh`` gives each attempt a store of its
own there. Here, plain ``torchrun`` on one node, where every attempt shares the agent's store and
:func:`rollpacker.runtime.world.attempt_store` keeps the attempts' keys apart.
"""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from rollpacker.runtime.world import attempt_store
from testkit import run_torchrun

AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1", "GROUP_WORLD_SIZE": "1"}


def test_a_killed_rank_restarts_and_every_group_is_built_again(tmp_path):
    proc = run_torchrun(2, ["--max-restarts=1", "tests/dist/world_restart.py", str(tmp_path)], timeout=300)
    assert "exitcode: -9" in proc.stderr  # the first attempt did end with rank 1 killed
    for attempt in (0, 1):
        for rank in (0, 1):
            sums = json.loads((tmp_path / f"attempt{attempt}_rank{rank}.json").read_text())
            if (attempt, rank) == (1, 1):  # it looked for rank 0's keys before rank 0 wrote them again
                assert sums.pop("peer_keys_found_before_the_peer_wrote") is False
            assert sums == {"default": 2.0, "control": 2.0, "tp2": 2.0, "tp2_control": 2.0}


def test_each_attempt_has_keys_of_its_own_on_the_agents_store():
    shared = dist.HashStore()
    attempt_store(shared, {**AGENT, "TORCHELASTIC_RESTART_COUNT": "0"}).set("rank_1", "dead worker")
    restarted = attempt_store(shared, {**AGENT, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not restarted.check(["rank_1"])
    # a store of the attempt's own (no torchrun, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) is used as is
    assert attempt_store(shared, {"TORCHELASTIC_USE_AGENT_STORE": "False"}) is shared


def test_a_multi_node_restartable_job_on_the_agents_store_is_refused():
    env = {**AGENT, "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0"}
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        attempt_store(dist.HashStore(), env)
    attempt_store(dist.HashStore(), {**env, "TORCHELASTIC_MAX_RESTARTS": "0"})  # no restart, no clash
