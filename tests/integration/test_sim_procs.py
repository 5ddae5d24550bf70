"""The simulator run as a module (``python -m rollpacker.sim``), in a process of its own. The rest of
the simulator: tests/unit/test_sim.py."""
from __future__ import annotations

import subprocess
import sys

from testkit import REPO_ROOT


def test_module_entry_point_prints_the_report():
    proc = subprocess.run([sys.executable, "-m", "rollpacker.sim", "--model", "7b", "--gpus", "2", "--tp", "1",
                           "--p0", "8", "--r0", "4", "--limit", "4096", "--rounds", "5", "--planner"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "speedup: amortized" in proc.stdout and "Qwen2.5-7B on 2 x H800" in proc.stdout
