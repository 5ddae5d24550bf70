"""The GPU machine's package set and the carried SGLang 0.5.17 bundle, built and cached by the tests themselves.

``tests/integration/test_sglang_gpu_bundle.py`` imports sglang's Engine path from the bundle on the packages the GPU
machine has, on this CPU (``bench/tools/sglang_imports.py --fake-cuda``). Its two inputs live in
``<repo>/.cache/sglang-gpu/`` (git-ignored), each rebuilt only when the stamp of its inputs changes:

- ``venv/``: a Python 3.12 venv (the machine's Python) holding PyPI's ``torch==2.11.0`` for cp312, which is
  the machine's 2.11.0+cu130 build, with the nvidia-*, cuda-toolkit and triton 3.6.0 it depends on, and of
  the machine's other documented packages (``bench.tools.sglang_bundle.HELD_VERSIONS`` and ``HELD_NAMES``) only
  those the Engine path imports (``HELD_SUBSET``), at the machine's versions where they are recorded. It
  models the machine; it is not our CPU base environment (no ``--system-site-packages``).
- ``bundle/sglang-0.5.17/``: ``python -m bench.tools.sglang_bundle build`` from the tracked lock, packed with a
  fast codec (``BUNDLE_ARGS``: the device's codec is about the size of a call, not what this check tests).

Building both from nothing downloads ~3.5 GB (torch and its CUDA libraries ~3 GB; the bundle's 44 wheels
0.5 GB) and takes a few minutes; the two builds run side by side. A file lock serialises parallel test
workers. A test run that collects the test starts the build in the background at collection
(``build_in_background``, tests/conftest.py), so that it overlaps the tests before it.

Run ``python tests/sglang_gpu/env.py`` to build them by hand.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

from bench.tools.bundle_resolve import find_python  # noqa: E402
from bench.tools.sglang_bundle import HELD_VERSIONS, ROOT_SPEC  # noqa: E402
from tests.sglang_cpu.env import build_lock  # noqa: E402

CACHE = REPO / ".cache" / "sglang-gpu"
VENV = CACHE / "venv"
BUNDLE_OUT = CACHE / "bundle"
BUNDLE = BUNDLE_OUT / ROOT_SPEC.replace("==", "-")
TIMES = CACHE / "build-seconds.json"
PYCACHE = CACHE / "pycache"  # bytecode of what the test's import run imports (its PYTHONPYCACHEPREFIX)
TORCH = f"torch=={HELD_VERSIONS['torch']}"
BUNDLE_ARGS = ["--codec", "zstd", "--level", "1"]
# what decides the bundle: the lock, the allowlist and prune list, the code that packs
BUNDLE_INPUTS = ["bench/tools/locks/sglang-0.5.17.json", "bench/tools/sglang_bundle.py", "bench/tools/bundle_resolve.py",
                 "bench/tools/bundle_pack.py"]

# The machine's packages that sglang's Engine path (bench/tools/sglang_imports.py) imports, each with the module that
# first needs it, found by trial: the venv held torch alone, and each failed import added back the held package
# it named, until every step and ServerArgs passed (2026-11-27). Versions: the machine's where HELD_VERSIONS
# records them; the others' are not recorded, so they are pinned to the releases the trial installed. Installed
# without their dependencies: a dependency that the path does not import would hide one that it does.
HELD_SUBSET = {
    "numpy": HELD_VERSIONS["numpy"],  # torch, sglang throughout (the bundle leaves numpy 2.3.5 out)
    "safetensors": HELD_VERSIONS["safetensors"],  # transformers checks its version at import (utils/versions.py)
    "huggingface-hub": HELD_VERSIONS["huggingface-hub"],  # transformers.utils.logging
    "sentencepiece": HELD_VERSIONS["sentencepiece"],  # transformers.tokenization_utils_sentencepiece
    "torchvision": HELD_VERSIONS["torchvision"],  # sglang.srt.utils.common (torchvision.io)
    "pyyaml": "6.0.4",  # rollpacker.configlib: our server arguments
    "psutil": "7.2.2",  # sglang.srt.utils.common
    "pillow": "13.0.0",  # sglang.srt.utils.common
    "anyio": "4.16.0",  # starlette.routing, from sglang.srt.utils.common
    "annotated-doc": "0.0.7",  # fastapi
    "click": "8.5.1",  # uvicorn.main
    "pygments": "2.21.0",  # IPython
    "requests": "2.34.2",  # flashinfer.artifacts
    "urllib3": "2.8.0",  # requests
    "idna": "3.20",  # requests
    "certifi": "2026.10.19.post1",  # requests
    "charset-normalizer": "3.5.3",  # requests (optional: without it, a warning at import)
    "packaging": "26.4",  # flashinfer.jit.cpp_ext
    "nvidia-ml-py": "13.615.71",  # pynvml: flashinfer/utils.py:24
    "tqdm": "4.70.1",  # huggingface_hub, transformers
    "regex": "2026.11.19",  # transformers.utils.auto_docstring
    "httpx": "0.28.1",  # transformers.utils.hub
    "httpcore": "1.0.9",  # httpx
    "h11": "0.16.0",  # httpcore
    "aiohttp": "3.14.5",  # sglang.lang.backend.runtime_endpoint
    "multidict": "7.2.1",  # aiohttp
    "attrs": "26.1.0",  # aiohttp
    "yarl": "1.25.1",  # aiohttp
    "propcache": "0.5.4",  # yarl
    "aiohappyeyeballs": "2.7.1",  # aiohttp
    "aiosignal": "1.4.0",  # aiohttp
    "frozenlist": "1.8.0",  # aiosignal
    "uvloop": "0.23.0",  # sglang.srt.entrypoints.engine
    "einops": "0.8.2",  # sglang.srt.layers.moe.moe_runner.deep_gemm
}


def _log(msg: str) -> None:
    print(f"[sglang-gpu] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list, log: Path | None = None) -> None:
    proc = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=REPO)
    if log is not None:
        log.write_text(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:6]))} ... failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")


def _digest(spec) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def python312() -> str:
    py = find_python(None)
    version = subprocess.check_output([py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], text=True)
    if version.strip() != "3.12":
        raise RuntimeError(f"no Python 3.12 here (found {py}, {version.strip()}): the GPU machine's Python, which "
                           "the bundle's cp312 wheels need")
    return py


def venv_python() -> Path:
    return VENV / "bin" / "python"


def _venv_stamp(py: str) -> str:
    version = subprocess.check_output([py, "-c", "import sys; print(sys.version)"], text=True)
    return _digest({"python": version, "torch": TORCH, "held": HELD_SUBSET})


def _bundle_stamp() -> str:
    return _digest({"args": BUNDLE_ARGS, **{p: hashlib.sha256((REPO / p).read_bytes()).hexdigest()
                                            for p in BUNDLE_INPUTS}})


def _build_venv(py: str) -> None:
    shutil.rmtree(VENV, ignore_errors=True)
    _run([py, "-m", "venv", VENV])
    # --no-compile: the test's import run writes the bytecode of what it imports (PYCACHE), a fraction of torch's
    pip = [venv_python(), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-cache-dir",
           "--no-compile"]
    _log(f"installing {TORCH} with its CUDA dependencies (~3 GB)")
    _run([*pip, TORCH])
    _log(f"installing {len(HELD_SUBSET)} held packages the Engine path imports")
    _run([*pip, "--no-deps", *(f"{k}=={v}" for k, v in HELD_SUBSET.items())])


def _build_bundle() -> None:
    shutil.rmtree(PYCACHE, ignore_errors=True)  # the old tree's bytecode
    _run([sys.executable, "-m", "bench.tools.sglang_bundle", "build", *BUNDLE_ARGS, "--out", BUNDLE_OUT,
          "--cache", CACHE / "wheels"], log=CACHE / "bundle-build.log")


def locked():
    return build_lock(CACHE, "the GPU package set and bundle", _log)


def ensure() -> dict:
    """Builds what is stale (the caller holds ``locked()``); returns ``{"venv": s, "bundle": s}``, the
    seconds each build took when it was last built, and ``built``, what this call built."""
    py = python312()
    jobs = {}
    venv_stamp, venv_file = _venv_stamp(py), VENV / "rollpacker-stamp"
    if not (venv_python().exists() and venv_file.exists() and venv_file.read_text() == venv_stamp):
        jobs["venv"] = (lambda: _build_venv(py), venv_file, venv_stamp)
    bundle_stamp, bundle_file = _bundle_stamp(), BUNDLE / "rollpacker-stamp"
    if not (bundle_file.exists() and bundle_file.read_text() == bundle_stamp):
        jobs["bundle"] = (_build_bundle, bundle_file, bundle_stamp)
    times = json.loads(TIMES.read_text()) if TIMES.exists() else {}
    errors: dict[str, BaseException] = {}

    def job(name, build, stamp_file, stamp):
        t = time.monotonic()
        try:
            build()
        except BaseException as exc:
            errors[name] = exc
            return
        stamp_file.write_text(stamp)
        times[name] = round(time.monotonic() - t, 1)
        _log(f"{name} built in {times[name]:.0f} s")

    # side by side: the venv is mostly download and unzip, the bundle mostly install and pack
    threads = [threading.Thread(target=job, args=(name, *spec)) for name, spec in jobs.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if jobs:
        TIMES.write_text(json.dumps(times) + "\n")
    if errors:
        raise RuntimeError("; ".join(f"{name}: {exc}" for name, exc in errors.items()))
    return {**times, "built": sorted(jobs)}


def build_in_background(log: Path) -> subprocess.Popen:
    """``ensure()`` in a process of its own (this file run as a script), its output to ``log``; the test's
    own ``ensure()`` then waits on the lock and finds both current (or builds again and fails with why)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


if __name__ == "__main__":
    t0 = time.monotonic()
    with locked():
        print(ensure(), f"({time.monotonic() - t0:.0f} s)")
