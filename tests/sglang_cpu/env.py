"""A CPU virtual environment with the real ``sglang``, built and cached by the tests themselves.

The version is 0.5.23 (the pin) unless ``ROLLPACKER_SGLANG_VERSION`` names another supported one
(``rollpacker.rollout.sglang_api.SUPPORTED_SGLANG``): ``ROLLPACKER_SGLANG_VERSION=0.5.17 python -m
pytest tests/integration/test_sglang_real.py`` runs the real-engine tests against 0.5.17 in a venv of its own
(not part of the default CI run).

``pip install sglang`` cannot work here: the wheels pin CUDA torch builds (0.5.23: 2.14.1, 0.5.17:
2.11.0) and CUDA-only kernel packages that have no CPU build. Their Python code, however, runs our
Qwen2 policy on CPU with the torch 2.13.0+cpu we test against. So the venv inherits the base
environment (``--system-site-packages``) and adds only what the base lacks:

- the sglang wheel itself, ``--no-deps``;
- its requirements read from the wheel's METADATA, minus the CUDA-only ones and minus those the base
  already satisfies;
- under a constraints file that pins every base distribution to its installed version, so that the
  torch, transformers and tokenizers the tests compare against are the ones sglang runs on (an
  sglang pin that disagrees with the base, e.g. ``transformers==5.19.0``, is dropped and reported);
- two shims (``shims/``) for the two places where sglang's import path assumes CUDA.

The venv lives in ``<repo>/.cache/sglang-cpu/venv`` (``venv-<version>`` for a version other than the
pin; git-ignored) and is rebuilt only when the stamp of its inputs changes. A file lock serialises
parallel test workers; the shims are re-synced on every call, which is cheap and keeps an edited
shim from going stale.

Run ``python tests/sglang_cpu/env.py [VERSION]`` to build it by hand.
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
from typing import Callable, Iterator

DEFAULT_VERSION = "0.5.23"  # the pin; the venv every test run builds
VERSION_ENV = "ROLLPACKER_SGLANG_VERSION"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "sglang-cpu"
SHIMS = Path(__file__).resolve().parent / "shims"

# Requirements of the 0.5.23 and 0.5.17 wheels that are CUDA builds or exist to fetch or compile them
# (none has a CPU build that would load against torch 2.13.0+cpu), or that only quantized models use;
# the CPU engine path imports none of them. (``kernels`` is the Hugging Face kernel hub; sglang uses it
# only to download its flash-attention-3 CUDA kernel. 0.5.17 only: ``helion``, a Triton kernel DSL
# imported by one MoE Triton helper; ``tokenspeed-mla``, an MLA CUDA kernel; ``torchao``, imported
# inside ``layers/torchao_utils.py``'s quantization functions only.)
CUDA_ONLY = frozenset({
    "cuda-python", "flashinfer-python", "sglang-kernel", "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla",
    "flash-attn-4", "quack-kernels", "tilelang", "humming-kernels", "torch-memory-saver", "torchaudio",
    "torchcodec", "nvshmem4py-cu13", "kernels", "helion", "tokenspeed-mla", "torchao",
})
CUDA_ONLY_PREFIXES = ("nvidia-",)

# Requirements that cannot resolve against the held base and that sglang imports only optionally.
CONFLICT_WITH_BASE = {
    # every release >= 1.11.5 needs numpy<2.4 (the base has 2.4); sglang imports it inside
    # try/except, for Mistral tokenizers only
    "mistral-common": "needs numpy<2.4",
}

# Distributions a release needs at its own versions rather than the base's: the venv installs the
# wheel's pin over the base's (the dependencies named after it are resolved afresh for that pin).
# The tests' transformers reference then runs in the venv too (host_checks.py), so both sides agree.
OVER_BASE = {
    # 0.5.17 registers the "qwen3_asr" config without exist_ok (sglang/srt/configs/qwen3_asr.py:167;
    # 0.5.23 passes exist_ok=True), and the base's transformers 5.24 already has one: importing
    # sglang.srt.entrypoints.engine raises "'qwen3_asr' is already used by a Transformers config".
    # transformers 5.12.1 needs tokenizers<=0.23.0 and huggingface-hub<2 (the base: 0.23.3, 2.4).
    "0.5.17": ("transformers", "tokenizers", "huggingface-hub"),
}

# Environment the engine processes need (inherited by the processes sglang spawns).
ENGINE_ENV = {
    # Without it the scheduler takes the GPU path, looks for vllm and the engine never comes up
    # (sglang/srt/utils/common.py, ``is_cpu``: 0.5.17 line 208, 0.5.23 line 221).
    "SGLANG_USE_CPU_ENGINE": "1",
}


def _log(msg: str) -> None:
    print(f"[sglang-cpu] {msg}", file=sys.stderr, flush=True)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _base_versions() -> dict[str, str]:
    """Installed distributions of the interpreter running the tests (the venv's base). Not those
    vendored by setuptools: ``import setuptools`` puts its ``_vendor`` folder on ``sys.path``, so they
    come and go with what the process imported before, and with them the stamp (a rebuild each time)."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        if "_vendor" in Path(str(dist.locate_file(""))).parts:
            continue
        name = dist.metadata["Name"]
        if name and dist.version:
            out.setdefault(_norm(name), dist.version)
    return out


def version(requested: str | None = None) -> str:
    """The sglang version to build: ``requested``, else ``$ROLLPACKER_SGLANG_VERSION``, else the pin;
    refused unless the backend supports it."""
    from rollpacker.rollout.sglang_api import SUPPORTED_SGLANG

    out = requested or os.environ.get(VERSION_ENV) or DEFAULT_VERSION
    if out not in SUPPORTED_SGLANG:
        raise ValueError(f"sglang {out} is not supported by the backend; supported: {', '.join(SUPPORTED_SGLANG)}")
    return out


def venv_dir(ver: str) -> Path:
    """The pin's venv keeps its historical place (an existing cache stays valid)."""
    return CACHE / ("venv" if ver == DEFAULT_VERSION else f"venv-{ver}")


def _wheel(ver: str) -> Path:
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"sglang-{ver}-*.whl"))
    if not found:
        _log(f"downloading the sglang {ver} wheel")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels), f"sglang=={ver}"])
        found = sorted(wheels.glob(f"sglang-{ver}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download left no sglang-{ver} wheel in {wheels}")
    return found[0]


def _requirements(wheel: Path, ver: str, base: dict[str, str]) -> tuple[list[str], list[str]]:
    """(requirements to install, notes on the ones left out) from the wheel's METADATA."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(f"sglang-{ver}.dist-info/METADATA").decode()
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
        if name in OVER_BASE.get(ver, ()):
            notes.append(f"{req} installed over the base's {name}=={base.get(name)} (OVER_BASE)")
            install.append(str(req))
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


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _sync_shims(venv: Path) -> None:
    site = _site_packages(venv)
    for src in SHIMS.rglob("*"):
        if src.is_dir() or "__pycache__" in src.parts:
            continue
        dst = site / src.relative_to(SHIMS)
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)


def _build(venv: Path, ver: str, wheel: Path, install: list[str], notes: list[str], base: dict[str, str]) -> None:
    start = time.monotonic()
    if venv.exists():
        shutil.rmtree(venv)
    _log(f"creating {venv} (inherits the base site-packages)")
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    constraints = CACHE / f"constraints-{ver}.txt"
    held = {k: v for k, v in base.items() if k not in OVER_BASE.get(ver, ())}
    constraints.write_text("".join(f"{k}=={v}\n" for k, v in sorted(held.items())))
    for note in notes:
        _log(note)
    _log(f"installing {len(install)} requirements of sglang {ver} (CUDA-only ones skipped)")
    pip = [str(_python(venv)), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "--constraint", str(constraints), *install])
    _log(f"installing {wheel.name} --no-deps")
    _run([*pip, "--no-deps", str(wheel)])
    _log(f"built in {time.monotonic() - start:.0f} s")


@contextmanager
def build_lock(cache: Path, what: str, log: Callable[[str], None] = _log) -> Iterator[None]:
    """``cache``'s build lock, held while ``what`` is built or checked; says so when it must wait."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "build.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another process is building or checking {what}; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sglang_python(requested: str | None = None) -> Path:
    """Path of the venv's python with sglang ``version(requested)`` importable on CPU; builds the venv
    on first use."""
    ver = version(requested)
    venv = venv_dir(ver)
    with build_lock(CACHE, "the venv"):
        base = _base_versions()
        wheel = _wheel(ver)
        install, notes = _requirements(wheel, ver, base)
        stamp, stamp_file = _stamp(wheel, install, base), venv / "rollpacker-stamp"
        if not (_python(venv).exists() and stamp_file.exists() and stamp_file.read_text() == stamp):
            _build(venv, ver, wheel, install, notes, base)
            stamp_file.write_text(stamp)
        _sync_shims(venv)
    return _python(venv)


def build_in_background(log: Path) -> subprocess.Popen:
    """``sglang_python()`` started in a process of its own (this file run as a script), its output to
    ``log``. A test run that will need the venv starts it at collection, so that a build (about 70 s,
    most of it on one core) overlaps the tests before the first one that needs it. That test's own
    ``sglang_python()`` waits on the lock, then finds the venv current; if the background build failed,
    it builds again and fails with pip's reason."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def engine_env(base_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a process that starts an sglang engine with the venv's python."""
    env = dict(os.environ if base_env is None else base_env)
    env.update(ENGINE_ENV)
    # Our repo on the path; nothing of the caller's PYTHONPATH (it could shadow the venv's packages).
    env["PYTHONPATH"] = str(REPO)
    return env


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    t0 = time.monotonic()
    print(sglang_python(sys.argv[1] if len(sys.argv) > 1 else None), f"({time.monotonic() - t0:.0f} s)")
