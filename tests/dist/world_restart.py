"""torchrun script: every process group of ``World`` is built again after torchrun restarts the workers.

Usage (2 ranks): torchrun --max-restarts 1 world_restart.py OUT_DIR. In the first attempt both ranks
build the world (default group, ``control``, the TP-1 and TP-2 rollout layouts), so the store holds
every group's keys; then rank 1 SIGKILLs itself and rank 0 fails on the lost peer. In the restart,
rank 0 comes up late, as a rank still loading would: it starts building only once rank 1 has looked
for its keys (rank 1's first wait for a key it did not write notes whether those keys were there
already, then sets a marker on the agent's store that rank 0 waits for). Were the attempts to share
keys, rank 1 would find the dead attempt's. Each rank of each attempt writes
OUT_DIR/attempt{N}_rank{R}.json with the sum of a collective over every group it is in; rank 1 of the
restart adds ``peer_keys_found_before_the_peer_wrote``.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rollpacker.runtime import world as world_module
from rollpacker.runtime.world import World


class FirstLookSignalled(dist.Store):
    """``inner`` (the attempt's store), which at the first wait or get of keys it did not set notes
    whether they exist, then sets ``marker`` on ``agent`` (the shared store)."""

    def __init__(self, inner: dist.Store, agent: dist.Store, marker: str):
        super().__init__()
        self.inner, self.agent, self.marker = inner, agent, marker
        self.written: set[str] = set()
        self.found: bool | None = None  # None until the first look

    def _look(self, keys: list[str]) -> None:
        theirs = [k for k in keys if k not in self.written]
        if theirs and self.found is None:
            self.found = self.inner.check(theirs)
            self.agent.set(self.marker, "1")

    def set(self, key, value):
        self.written.add(key)
        self.inner.set(key, value)

    def get(self, key):
        self._look([key])
        return self.inner.get(key)

    def wait(self, keys, *timeout):
        self._look(list(keys))
        return self.inner.wait(keys, *timeout)

    def add(self, key, value):
        return self.inner.add(key, value)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def main(out_dir: str) -> None:
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    looked = None
    if attempt > 0:
        agent = next(dist.rendezvous("env://", timeout=timedelta(minutes=5)))[0]
        marker = f"world_restart/attempt_{attempt}/rank1_looked"
        if rank == 0:
            agent.wait([marker])
        else:
            attempt_store = world_module.attempt_store

            def signalled(store, env):
                nonlocal looked
                looked = FirstLookSignalled(attempt_store(store, env), agent, marker)
                return looked

            world_module.attempt_store = signalled
    world = World.init()
    world.build_rollout_layouts([1, 2])
    tp2 = world.rollout[2]
    sums = {}
    for name, group in (("default", None), ("control", world.control), ("tp2", tp2.group),
                        ("tp2_control", tp2.control)):
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    if looked is not None:
        sums["peer_keys_found_before_the_peer_wrote"] = looked.found
    Path(out_dir, f"attempt{attempt}_rank{rank}.json").write_text(json.dumps(sums))
    if attempt == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier(group=world.control)  # rank 0 of the first attempt fails here
    world.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
