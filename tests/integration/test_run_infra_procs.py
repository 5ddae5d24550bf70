"""The program's control plane over 2 real torchrun ranks. Its one-process plumbing (checkpoints, phase
hand-offs, metrics): tests/unit/test_run_infra.py."""
from __future__ import annotations


def test_control_plane_collectives_avoid_the_device_group(tmp_path):
    """Stop flags, verify_sync, timelines, group broadcasts and endpoint exchange under NCCL's rule
    (no CPU tensors on the device group), over 2 real torchrun ranks."""
    from testkit import REPO_ROOT, run_torchrun
    proc = run_torchrun(2, ["tests/dist/control_plane.py", str(REPO_ROOT / "assets/policy"), str(tmp_path)],
                        timeout=300)
    assert proc.stdout.count("CONTROL_PLANE_OK") == 2
