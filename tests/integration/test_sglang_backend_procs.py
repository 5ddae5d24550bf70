"""SGLang backend with processes: real engine hosts (one that refuses a release, one whose rank died
before it could watch it), and each supported release's surface (``sglang_api.SURFACES``) against the
source of that release's wheel, which ``pip download`` fetches into a cache on first use. The backend's
logic against recording doubles, in one process: tests/unit/test_sglang_backend.py."""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import zipfile
from functools import cached_property, lru_cache
from pathlib import Path

import pytest

from rollpacker.rollout import make_engine
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.sglang_api import (SESSION_API, SGLANG_ENGINE_ATTRIBUTES, SGLANG_ENV, SGLANG_LOAD_FIELDS,
                                           SGLANG_OUTPUT_KEYS, SGLANG_SAMPLING_KEYS, SUPPORTED_SGLANG, SURFACES,
                                           UnsupportedSGLangError, installed_surface, surface_for)
from rollpacker.rollout.sglang_backend import SGLangEngine
from tests.unit.test_sglang_backend import RecordingEngine, _engine, in_process

WHEEL_CACHE = Path.home() / ".cache" / "rollpacker" / "wheels"


def test_sglang_is_imported_only_when_selected():
    _engine()
    assert "sglang" not in sys.modules  # neither the package import nor the double pulled it in
    if importlib.util.find_spec("sglang") is None:  # here: the engine host process imports it and says so
        with pytest.raises(RuntimeError, match="did not start: ModuleNotFoundError.*sglang"):
            make_engine(RolloutConfig(backend="sglang"), "/m", device="cpu")


def test_an_unsupported_sglang_is_refused_by_name(tmp_path, monkeypatch):
    """Only SUPPORTED_SGLANG: a double of another release, and a real engine host that finds another
    release installed (a bare distribution record first on its path), refuse to start, naming both."""
    names = " and ".join(SUPPORTED_SGLANG)
    with pytest.raises(UnsupportedSGLangError, match=f"sglang 0.5.20 is installed.*supports sglang {names} only"):
        surface_for("0.5.20")
    with pytest.raises(UnsupportedSGLangError, match="0.5.22"):
        SGLangEngine("/m", RolloutConfig(backend="sglang"), device="cpu", host=in_process(RecordingEngine, "0.5.22"))
    record = tmp_path / "sglang-0.5.16.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.16\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the host's path: ahead of any installed sglang
    refused = f"did not start: UnsupportedSGLangError: sglang 0.5.16 is installed.*{names}"
    with pytest.raises(RuntimeError, match=refused):
        make_engine(RolloutConfig(backend="sglang"), "/m", device="cpu")
    assert "sglang" not in sys.modules and installed_surface.cache_info().currsize == 0  # read by the host only


def test_an_engine_host_whose_rank_died_before_it_could_watch_it_exits(tmp_path):
    """The host asks the kernel to kill it with its rank (PR_SET_PDEATHSIG), but a rank that dies
    while the host is still starting is gone before that request: the host, reparented, would wait
    for a connection forever. A rank starts a host as the backend does, then exits at once."""
    import psutil

    from rollpacker.rollout.sglang_host import KEY_ENV, PARENT_ENV

    script = (f"import os, subprocess, sys\n"
              f"p = subprocess.Popen([sys.executable, '-m', 'rollpacker.rollout.sglang_host', "
              f"{str(tmp_path / 'host.sock')!r}], env={{**os.environ, {KEY_ENV!r}: '00', "
              f"{PARENT_ENV!r}: str(os.getpid())}}, start_new_session=True, stdout=subprocess.DEVNULL, "
              f"stderr=subprocess.DEVNULL)\n"
              f"print(p.pid, flush=True)\n"
              f"os._exit(0)\n")
    rank = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    host = int(rank.stdout)
    try:
        _, alive = psutil.wait_procs([psutil.Process(host)], timeout=30)
    except psutil.NoSuchProcess:
        alive = []
    for p in alive:
        p.kill()
    print(f"engine host {host} after its rank exited: {'still waiting' if alive else 'gone'}")
    assert not alive, "the engine host outlived its rank"


# ---- contract with each supported release -------------------------------------------------------
NETWORK_ERRORS = ("Network is unreachable", "Temporary failure in name resolution", "Max retries exceeded",
                  "Failed to establish a new connection", "Connection refused", "timed out", "ProxyError")


def _wheel(version: str) -> Path:
    """The release's wheel, downloaded once into the cache (about 20-40 MB; parsed, never installed)."""
    found = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
    if not found:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               f"sglang=={version}", "-d", str(WHEEL_CACHE)],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode and any(e in proc.stderr for e in NETWORK_ERRORS):
            pytest.skip(f"package index unreachable, cannot fetch sglang=={version}: "
                        f"{proc.stderr.strip().splitlines()[-1]}")
        assert proc.returncode == 0, proc.stderr
        found = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
    return found[0]


class WheelSource:
    """Classes, signatures and string constants of the wheel's Python source, via ``ast``."""

    def __init__(self, wheel: Path):
        self.zip = zipfile.ZipFile(wheel)
        self._trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self._trees:
            self._trees[path] = ast.parse(self.zip.read(path))
        return self._trees[path]

    def cls(self, path: str, name: str) -> ast.ClassDef:
        found = [n for n in ast.walk(self.tree(path)) if isinstance(n, ast.ClassDef) and n.name == name]
        assert found, f"class {name} not found in {path}"
        return found[0]

    @staticmethod
    def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
        return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    @staticmethod
    def fields(cls: ast.ClassDef) -> set[str]:
        return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}

    @cached_property
    def server_args_fields(self) -> set[str]:
        paths = ["sglang/srt/server_args.py"] + [n for n in self.zip.namelist()
                                                  if n.startswith("sglang/srt/arg_groups/fields/")
                                                  and n.endswith(".py")]
        return {f for p in paths for n in ast.walk(self.tree(p)) if isinstance(n, ast.ClassDef)
                for f in self.fields(n)}

    def strings(self, path: str) -> set[str]:
        return {n.value for n in ast.walk(self.tree(path)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}

    def function(self, path: str, name: str) -> ast.FunctionDef:
        found = [n for n in ast.walk(self.tree(path)) if isinstance(n, ast.FunctionDef) and n.name == name]
        assert found, f"function {name} not found in {path}"
        return found[0]

    def requires(self, version: str) -> list[str]:
        meta = self.zip.read(f"sglang-{version}.dist-info/METADATA").decode()
        return [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]


CLASSES = {"Engine": "sglang/srt/entrypoints/engine.py", "TokenizerManager": "sglang/srt/managers/tokenizer_manager.py"}


MIXINS = {"TokenizerManager": {"TokenizerControlMixin": "sglang/srt/managers/tokenizer_control_mixin.py"}}


WEIGHT_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"


@lru_cache(maxsize=None)
def wheel_source(version: str) -> WheelSource:
    return WheelSource(_wheel(version))


@pytest.mark.parametrize("version,qualname", [(v, q) for v in SUPPORTED_SGLANG for q in sorted(SURFACES[v].api)])
def test_every_call_exists_in_each_release(version, qualname):
    wheel, api = wheel_source(version), SURFACES[version].api
    owner, method = qualname.split(".")
    cls = wheel.cls(CLASSES[owner], owner)
    fn = wheel.methods(cls).get(method)
    for base, path in MIXINS.get(owner, {}).items():  # methods the class inherits from its mixins
        assert base in {b.id for b in cls.bases if isinstance(b, ast.Name)}, f"{owner} no longer mixes in {base}"
        fn = fn or wheel.methods(wheel.cls(path, base)).get(method)
    assert fn is not None, f"sglang=={version} has no {qualname}"
    a = fn.args
    params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
    if a.kwarg is not None and method == "__init__":  # Engine(**kwargs) builds ServerArgs from them
        params |= wheel.server_args_fields
    missing = set(api[qualname]) - params
    assert not missing, f"sglang=={version} {qualname} lacks keywords {sorted(missing)}"


@pytest.mark.parametrize("version", SUPPORTED_SGLANG)
def test_engine_attributes_sampling_keys_outputs_and_env_exist(version):
    wheel = wheel_source(version)
    engine_path = CLASSES["Engine"]
    assigned = {n.attr for n in ast.walk(wheel.cls(engine_path, "Engine"))
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    assert set(SGLANG_ENGINE_ATTRIBUTES) <= assigned | wheel.fields(wheel.cls(engine_path, "Engine"))
    sampling = wheel.fields(wheel.cls("sglang/srt/sampling/sampling_params.py", "SamplingParams"))
    assert set(SGLANG_SAMPLING_KEYS) <= sampling, set(SGLANG_SAMPLING_KEYS) - sampling
    out_strings = wheel.strings(CLASSES["TokenizerManager"])
    assert set(SGLANG_OUTPUT_KEYS) <= out_strings, set(SGLANG_OUTPUT_KEYS) - out_strings
    assert {"type", "stop", "length", "abort"} <= wheel.strings("sglang/srt/managers/schedule_batch.py")
    assert set(SGLANG_ENV) <= wheel.strings("sglang/srt/layers/sampler.py")
    load = wheel.fields(wheel.cls("sglang/srt/managers/load_snapshot.py", "LoadSnapshot"))
    assert set(SGLANG_LOAD_FIELDS) <= load, set(SGLANG_LOAD_FIELDS) - load


@pytest.mark.parametrize("version", SUPPORTED_SGLANG)
def test_each_surface_difference_matches_its_release(version):
    """Every field of ``SGLangSurface`` read off the release's own source."""
    wheel, surface = wheel_source(version), SURFACES[version]
    engine = wheel.methods(wheel.cls(CLASSES["Engine"], "Engine"))
    session = {m.split(".")[1] for m in SESSION_API}
    assert surface.weight_session == (session <= set(engine)), f"{version}: weight-update session methods"
    refusal = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
    refusal = refusal in wheel.strings(WEIGHT_UPDATER)
    assert surface.weight_session == refusal, f"{version}: a push outside the session refused"
    flush = wheel.function(WEIGHT_UPDATER, "flush_cache_after_weight_update")
    asserts = any(isinstance(n, ast.Assert) for n in ast.walk(flush))
    assert surface.flush_needs_idle == asserts, f"{version}: the scheduler asserts the flush after a push"
    per_rank = ast.unparse(engine["_serialize_tensors_per_rank"])
    assert surface.process_wide_config == ("get_parallel().tp_size" in per_rank), per_rank
    assert ("self.server_args.tp_size" in per_rank) != surface.process_wide_config, per_rank
    assert f"torch=={surface.torch}" in wheel.requires(version)
