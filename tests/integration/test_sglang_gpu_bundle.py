"""The carried SGLang 0.5.17 bundle imports sglang's Engine path on the GPU machine's package set (issue 43).

``tests/sglang_gpu/env.py`` builds and caches a Python 3.12 venv that models the GPU machine's packages (torch
2.11.0+cu130 and the documented packages the path imports) and the real bundle from its lock. This test unpacks
the bundle as the device does, ``unpack --check-held`` run by the venv's Python (whose packages then stand for
the machine's), checks that every file the manifest lists as pruned is absent, and runs ``bench.tools.sglang_imports
--fake-cuda`` on the unpacked tree, as ``bench/gpu/run.py`` runs it on the GPU without faking: every module of
the Engine path imports, ServerArgs accepts our GPU server arguments, and only the expected CUDA queries are
faked. It prints what it measured.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bench.tools.bundle_resolve import norm
from bench.tools.sglang_bundle import HELD_NAMES, HELD_VERSIONS
from bench.tools.sglang_imports import STEPS
from tests.sglang_gpu import env

SITE = env.CACHE / "site"
# torch.cuda answers as one H100 (bench/tools/sglang_imports.py, fake_h100), and this machine has no driver, so
# sgl_kernel's libraries load beside a stand-in libcuda.so.1; a new query on the path fails the import or lands
# in this list, and either way someone looks
EXPECTED_FAKED = ["torch.cuda.is_available", "torch.cuda.device_count", "torch.cuda.current_device",
                  "torch.cuda.get_device_capability", "torch.cuda.get_device_properties", "torch.cuda.mem_get_info",
                  "libcuda.so.1"]
MISMATCH = re.compile(r"HELD MISMATCH: (\S+) (\(not installed\)|\S+) does not satisfy (.*)")


@pytest.fixture(scope="module")
def sglang_gpu_bundle():
    """The venv and bundle, current; the lock is held while the test unpacks into and imports from the cache."""
    t = time.monotonic()
    with env.locked():
        built = env.ensure()
        yield {**built, "wait": time.monotonic() - t}


def _bytes(folder: Path) -> int:
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(folder) for n in names)


def _run(cmd: list, **kw) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], cwd=env.REPO, capture_output=True, text=True, **kw)
    return proc, time.monotonic() - t


def test_held_subset_is_of_the_machines_documented_packages():
    documented = {norm(n) for n in HELD_NAMES} | {norm(n) for n in HELD_VERSIONS}
    assert not set(env.HELD_SUBSET) - documented
    assert all(env.HELD_SUBSET[n] == v for n, v in HELD_VERSIONS.items() if n in env.HELD_SUBSET)


def test_bundle_imports_the_engine_path_on_the_machines_packages(sglang_gpu_bundle, tmp_path):
    py = env.venv_python()
    shutil.rmtree(SITE, ignore_errors=True)
    unpack, unpack_s = _run([py, "-m", "bench.tools.sglang_bundle", "unpack", "--parts", env.BUNDLE, "--dest", SITE,
                             "--check-held"], timeout=600)
    print(unpack.stdout[-3000:], unpack.stderr[-2000:])
    assert unpack.returncode == 0
    # a held package on the path, at the machine's version, that the bundle's wheels refuse; the other
    # mismatches are held packages the venv lacks because the path never imports them
    mismatches = [m.groups() for m in map(MISMATCH.match, unpack.stdout.splitlines()) if m]
    assert [m for m in mismatches if m[1] != "(not installed)"] == []

    manifest = json.loads((env.BUNDLE / "meta" / "manifest.json").read_text())
    pruned = manifest["pruned"]
    assert pruned, "the manifest lists no pruned file"
    assert [p["path"] for p in pruned if os.path.lexists(SITE / p["path"])] == []

    out = tmp_path / "imports.json"
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    # bytecode beside the cache, not in the tree the manifest describes; tar keeps mtimes, so it stays valid
    child_env.update(PYTHONPATH=f"{SITE}:{env.REPO}", PYTHONPYCACHEPREFIX=str(env.PYCACHE))
    imports, imports_s = _run([py, "-m", "bench.tools.sglang_imports", "--fake-cuda", "--json", out], env=child_env,
                              timeout=900)
    print(imports.stdout[-6000:], imports.stderr[-4000:])
    assert out.exists(), "bench.tools.sglang_imports wrote no report"
    report = json.loads(out.read_text())

    assert report["first_failure"] is None, report["first_failure"]
    assert [s["module"] for s in report["steps"]] == [m for m, _ in STEPS]
    assert report["server_args"]["ok"], report["server_args"]
    assert report["server_args"]["resolved"]["attention_backend"] == "triton"
    assert report["server_args"]["resolved"]["sampling_backend"] == "pytorch"
    assert report["model_registry"]["Qwen2ForCausalLM"]
    assert [f["what"] for f in report["faked"]] == EXPECTED_FAKED
    assert report["sgl_kernel_common_ops"] == str(SITE / "sgl_kernel" / "sm90" / "common_ops.abi3.so")
    assert report["sgl_kernel_common_ops"] in report["loaded_libraries"]
    assert report["versions"]["sglang"] == "0.5.17" and report["versions"]["torch"] == HELD_VERSIONS["torch"]
    assert report["ok"] and imports.returncode == 0

    parts = sum(p["bytes"] for p in manifest["parts"])
    lines = [
        f"build (seconds when last built; built now: {', '.join(sglang_gpu_bundle['built']) or 'nothing'}): "
        f"venv {sglang_gpu_bundle.get('venv')}, bundle {sglang_gpu_bundle.get('bundle')}; "
        f"waited {sglang_gpu_bundle['wait']:.1f} s here",
        f"venv: {_bytes(env.VENV) / 1e9:.2f} GB, torch {report['versions']['torch']}, "
        f"{len(env.HELD_SUBSET)} held packages besides torch's dependencies",
        f"bundle: {len(manifest['wheels'])} wheels, {parts / 2**20:.1f} MiB in {len(manifest['parts'])} part(s) "
        f"({manifest['codec']} -{manifest['level']}); installed {manifest['install']['bytes'] / 1e6:.1f} MB; "
        f"{len(pruned)} files pruned ({sum(p.get('bytes') or 0 for p in pruned) / 1e6:.1f} MB), all absent",
        f"unpack --check-held: {unpack_s:.1f} s; held packages not on the path (not installed here): "
        f"{', '.join(sorted({m[0] for m in mismatches})) or 'none'}",
        f"bench.tools.sglang_imports --fake-cuda: {imports_s:.1f} s in all (torch {report['torch_import_seconds']:.1f} s)",
        *(f"  {s['seconds']:6.2f} s  {s['module']}" for s in report["steps"]),
        f"  {report['server_args']['seconds']:6.2f} s  ServerArgs",
        "faked: " + ", ".join(f["what"] + ("" if f["calls"] is None else f" x{f['calls']}") for f in report["faked"])
        + f"; libcuda.so.1 exports {', '.join(report['driver']['symbols'])} for {len(report['driver']['for'])} "
        "sgl_kernel libraries",
        f"model registry: {report['model_registry']['models']} architectures; skipped: "
        f"{'; '.join(report['model_registry']['skipped']) or 'none'}",
    ]
    print("\n".join(lines))
