"""A CPU virtual environment with the real ``sglang`` 0.5.23, built and cached by the tests themselves.

``pip install sglang`` cannot work here: the 0.5.23 wheel pins CUDA torch 2.14.1 and CUDA-only kernel
packages that have no CPU build. Its Python code, however, runs our Qwen2 policy on CPU with the
torch 2.13.0+cpu we test against. So the venv inherits the base environment
(``--system-site-packages``) and adds only what the base lacks:

- the sglang wheel itself, ``--no-deps``;
- its requirements read from the wheel's METADATA, minus the CUDA-only ones and minus those the base
  already satisfies;
- under a constraints file that pins every base distribution to its installed version, so that the
  torch, transformers and tokenizers the tests compare against are the ones sglang runs on (an
  sglang pin that disagrees with the base, e.g. ``transformers==5.19.0``, is dropped and reported);
- two shims (``shims/``) for the two places where sglang's import path assumes CUDA.

The venv lives in ``<repo>/.cache/sglang-cpu/venv`` (git-ignored) and is rebuilt only when the stamp
of its inputs changes. A file lock serialises parallel test workers; the shims are re-synced on
every call, which is cheap and keeps an edited shim from going stale.

Run ``python tests/sglang_cpu/env.py`` to build it by hand.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Iterator

SGLANG_VERSION = "0.5.23"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "sglang-cpu"
VENV = CACHE / "venv"
SHIMS = Path(__file__).resolve().parent / "shims"

# Requirements of the 0.5.23 wheel that are CUDA builds or exist to fetch them: none has a CPU build
# that would load against torch 2.13.0+cpu, and the CPU engine path imports none of them. (``kernels``
# is the Hugging Face kernel hub; sglang uses it only to download its flash-attention-3 CUDA kernel.)
CUDA_ONLY = frozenset({
    "cuda-python", "flashinfer-python", "sglang-kernel", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
    "flash-attn-4", "quack-kernels", "tilelang", "humming-kernels", "torch-memory-saver", "torchaudio",
    "torchcodec", "nvshmem4py-cu13", "kernels",
})
CUDA_ONLY_PREFIXES = ("nvidia-",)

# Requirements that cannot resolve against the held base and that sglang imports only optionally.
CONFLICT_WITH_BASE = {
    # every release >= 1.11.5 needs numpy<2.4 (the base has 2.4); sglang 0.5.23 imports it inside
    # try/except, for Mistral tokenizers only
    "mistral-common": "needs numpy<2.4",
}

# Environment the engine processes need (inherited by the processes sglang spawns).
ENGINE_ENV = {
    # Without it the 0.5.23 scheduler takes the GPU path, looks for vllm and the engine never comes up.
    "SGLANG_USE_CPU_ENGINE": "1",
}


def _log(msg: str) -> None:
    print(f"[sglang-cpu] {msg}", file=sys.stderr, flush=True)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _base_versions() -> dict[str, str]:
    """Installed distributions of the interpreter running the tests (the venv's base)."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and dist.version:
            out.setdefault(_norm(name), dist.version)
    return out


def _wheel() -> Path:
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        _log(f"downloading the sglang {SGLANG_VERSION} wheel")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels),
              f"sglang=={SGLANG_VERSION}"])
        found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download left no sglang-{SGLANG_VERSION} wheel in {wheels}")
    return found[0]


def _requirements(wheel: Path, base: dict[str, str]) -> tuple[list[str], list[str]]:
    """(requirements to install, notes on the ones left out) from the wheel's METADATA."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"sglang-{SGLANG_VERSION}.dist-info/METADATA").decode()
    install, notes = [], []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra, or another platform
        name = _norm(req.name)
        if name in CUDA_ONLY or name.startswith(CUDA_ONLY_PREFIXES):
            continue
        if name in CONFLICT_WITH_BASE:
            notes.append(f"{req} dropped: {CONFLICT_WITH_BASE[name]} (optional import in sglang)")
            continue
        have = base.get(name)
        if have is None:
            install.append(str(req))
        elif not req.specifier.contains(have, prereleases=True):
            notes.append(f"{req} dropped: the base's {name}=={have} is held")
    return install, notes


def _stamp(wheel: Path, install: list[str], base: dict[str, str]) -> str:
    spec = dict(sglang=wheel.name, python=sys.version, install=sorted(install),
                held=sorted(f"{k}=={v}" for k, v in base.items()))
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}):\n{proc.stdout[-6000:]}")


def _site_packages() -> Path:
    return VENV / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _python() -> Path:
    return VENV / "bin" / "python"


def _sync_shims() -> None:
    site = _site_packages()
    for src in SHIMS.rglob("*"):
        if src.is_dir() or "__pycache__" in src.parts:
            continue
        dst = site / src.relative_to(SHIMS)
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)


def _build(wheel: Path, install: list[str], notes: list[str], base: dict[str, str]) -> None:
    start = time.monotonic()
    if VENV.exists():
        shutil.rmtree(VENV)
    _log(f"creating {VENV} (inherits the base site-packages)")
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)])
    constraints = CACHE / "constraints.txt"
    constraints.write_text("".join(f"{k}=={v}\n" for k, v in sorted(base.items())))
    for note in notes:
        _log(note)
    _log(f"installing {len(install)} requirements of sglang {SGLANG_VERSION} (CUDA-only ones skipped)")
    pip = [str(_python()), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "--constraint", str(constraints), *install])
    _log(f"installing {wheel.name} --no-deps")
    _run([*pip, "--no-deps", str(wheel)])
    _log(f"built in {time.monotonic() - start:.0f} s")


@contextmanager
def _locked() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "build.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log("another process is building or checking the venv; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sglang_python() -> Path:
    """Path of the venv's python with sglang importable on CPU; builds the venv on first use."""
    with _locked():
        base = _base_versions()
        wheel = _wheel()
        install, notes = _requirements(wheel, base)
        stamp, stamp_file = _stamp(wheel, install, base), VENV / "rollpacker-stamp"
        if not (_python().exists() and stamp_file.exists() and stamp_file.read_text() == stamp):
            _build(wheel, install, notes, base)
            stamp_file.write_text(stamp)
        _sync_shims()
    return _python()


def engine_env(base_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a process that starts an sglang engine with the venv's python."""
    env = dict(os.environ if base_env is None else base_env)
    env.update(ENGINE_ENV)
    # Our repo on the path; nothing of the caller's PYTHONPATH (it could shadow the venv's packages).
    env["PYTHONPATH"] = str(REPO)
    return env


if __name__ == "__main__":
    t0 = time.monotonic()
    print(sglang_python(), f"({time.monotonic() - t0:.0f} s)")
