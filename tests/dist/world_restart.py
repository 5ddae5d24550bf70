"""torchrun script: every process group of ``World`` is built again after torchrun restarts the workers.

Usage (2 ranks): torchrun --max-restarts 1 world_restart.py OUT_DIR. In the first attempt both ranks
build the world (default group, ``control``, the TP-1 and TP-2 rollout layouts), so the store holds
every group's keys; then rank 1 SIGKILLs itself and rank 0 fails on the lost peer. In the restart,
rank 0 comes up late, as a rank still loading would: rank 1 then reads rank 0's keys before rank 0
writes them again, the dead attempt's addresses if the attempts share keys. Each rank of each attempt
writes OUT_DIR/attempt{N}_rank{R}.json with the sum of a collective over every group it is in.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rollpacker.runtime.world import World


def main(out_dir: str) -> None:
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if attempt > 0 and rank == 0:
        time.sleep(3)
    world = World.init()
    world.build_rollout_layouts([1, 2])
    tp2 = world.rollout[2]
    sums = {}
    for name, group in (("default", None), ("control", world.control), ("tp2", tp2.group),
                        ("tp2_control", tp2.control)):
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    Path(out_dir, f"attempt{attempt}_rank{rank}.json").write_text(json.dumps(sums))
    if attempt == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier(group=world.control)  # rank 0 of the first attempt fails here
    world.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
