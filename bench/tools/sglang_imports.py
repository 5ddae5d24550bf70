"""sglang.Engine's start path, imported module by module: does the carried SGLang 0.5.17 bundle load on
this machine's packages?

    python -m bench.tools.sglang_imports [--fake-cuda] [--json FILE] [--model DIR]

Run with the unpacked bundle first on ``PYTHONPATH`` (``bench/tools/sglang_bundle.py``). It sets
``GPU_ENGINE_ENV`` (``rollpacker.rollout.sglang_args``), imports what a GPU engine with the triton
attention backend and the pytorch sampler loads in its processes (``STEPS``: the engine host's engine
and tokenizer manager, the detokenizer, the scheduler with its model runner, CUDA graph runner,
attention backend, sampler, model loader, model registry and Qwen2), each timed, then builds sglang's
``ServerArgs`` from our GPU server arguments to prove the release accepts them. The first failure is
recorded with the module that failed and what it lacked, and the steps after it as not reached; the
exit status is 1 unless every step passed.

``--fake-cuda`` is for a machine without a GPU: the ``torch.cuda`` queries on the path answer as one
H100 would (``fake_h100``; each patched function and how often it was called is listed in the JSON),
and where the driver library is absent, a stand-in ``libcuda.so.1`` is compiled (``cc``; ``nm`` and
``readelf`` find what it must export) with the driver functions that the ``sgl_kernel`` libraries
import, each returning ``CUDA_ERROR_NO_DEVICE``. The libraries then load for real: every other symbol
resolved against torch's and CUDA's libraries, their operators registered with torch. Nothing on the
import path calls the driver; what is loaded from the bundle is listed (``loaded_libraries``) either way.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "assets" / "policy"
BACKENDS = {"attention_backend": "triton", "sampling_backend": "pytorch"}

# (module, where the engine imports it); sources are sglang 0.5.17's, under sglang/srt/
STEPS = (
    ("sgl_kernel", "imported by sglang's CUDA layers; loads sgl_kernel/sm90/common_ops on compute capability 9.0"),
    ("sglang.srt.entrypoints.engine", "sglang.Engine, in the engine host process"),
    ("sglang.srt.managers.tokenizer_manager", "the tokenizer manager, in the engine host process"),
    ("sglang.srt.managers.detokenizer_manager", "the detokenizer process (run_detokenizer_process)"),
    ("sglang.srt.managers.scheduler", "the scheduler process (run_scheduler_process)"),
    ("sglang.srt.managers.tp_worker", "the scheduler's TP worker"),
    ("sglang.srt.model_executor.model_runner", "the TP worker's model runner"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner",
     "CUDA graph capture (model_runner.py:1236, imported when the graphs are built)"),
    ("sglang.srt.layers.attention.triton_backend",
     'attention_backend="triton" (layers/attention/attention_registry.py, imported when the backend is made)'),
    ("sglang.srt.layers.sampler", 'the sampler, sampling_backend="pytorch"'),
    ("sglang.srt.model_loader.loader", "the model loader (model_loader/__init__.py)"),
    ("sglang.srt.models.registry",
     "the model registry: imports every sglang.srt.models module, logging and skipping those that fail"),
    ("sglang.srt.models.qwen2", "the Qwen2 model our policy is"),
)

# One H100 as its callers on the import path ask torch about it: sgl_kernel's loader reads the compute
# capability from get_device_properties (9.0 loads sgl_kernel/sm90/, sgl_kernel/load_utils.py:15-25),
# sglang's layers from get_device_capability, and ServerArgs sizes its defaults from mem_get_info where
# nvidia-smi is absent (srt/utils/common.py:609-653): 79.18 GiB, as torch reported the lent H100 80GB HBM3
# (docs/gpu/2026-11-23-h100)
H100_CAPABILITY = (9, 0)
H100_MEMORY = 81_080 << 20
# sglang's model registry logs each model module it skips here (models/registry.py:109)
REGISTRY_LOGGER = "sglang.srt.models.registry"
CUDA_ERROR_NO_DEVICE = 100
# driver API entry points (cuInit, cuMemAlloc_v2, ...); the runtime's are cuda*, the libraries' cublas*, ...
DRIVER_SYMBOL = re.compile(r"cu[A-Z]\w*")


class _Recorder:
    """Patches attributes and counts the calls to each, for the JSON's ``faked`` list."""

    def __init__(self):
        self.faked: list[dict] = []

    def patch(self, owner, name: str, value, shown: str):
        entry = {"what": f"{owner.__name__}.{name}", "as": shown, "calls": 0}
        self.faked.append(entry)

        def counted(*args, **kwargs):
            entry["calls"] += 1
            return value

        setattr(owner, name, counted)


def fake_h100(recorder: _Recorder) -> None:
    import torch

    major, minor = H100_CAPABILITY
    recorder.patch(torch.cuda, "is_available", True, "True")
    recorder.patch(torch.cuda, "device_count", 1, "1")
    recorder.patch(torch.cuda, "current_device", 0, "0")
    recorder.patch(torch.cuda, "get_device_capability", H100_CAPABILITY, repr(H100_CAPABILITY))
    recorder.patch(torch.cuda, "get_device_properties", types.SimpleNamespace(major=major, minor=minor),
                   f"major={major}, minor={minor} (no other field)")
    recorder.patch(torch.cuda, "mem_get_info", (H100_MEMORY, H100_MEMORY), f"({H100_MEMORY}, {H100_MEMORY}): all free")


def _elf_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.so*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF")


def _needs(lib: Path, soname: str) -> bool:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    return f"[{soname}]" in out


def driver_standin(workdir: Path) -> dict:
    """The driver library: the machine's if it loads, else a compiled stand-in (module docstring)."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return {"libcuda.so.1": "the machine's"}
    except OSError as e:
        absent = str(e)
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        return {"libcuda.so.1": f"absent ({absent}); no sgl_kernel to load"}
    users = [p for p in _elf_files(Path(next(iter(spec.submodule_search_locations))))
             if _needs(p, "libcuda.so.1")]
    symbols = set()
    for lib in users:
        out = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True,
                             check=True).stdout
        symbols.update(s for s in (line.split()[-1] for line in out.splitlines()) if DRIVER_SYMBOL.fullmatch(s))
    source, so = workdir / "libcuda_standin.c", workdir / "libcuda.so.1"
    source.write_text("".join(f"int {s}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for s in sorted(symbols)))
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(so), str(source)], check=True)
    ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)  # later loads find libcuda.so.1 by its soname
    return {"libcuda.so.1": f"stand-in (the driver is absent: {absent})", "symbols": sorted(symbols),
            "for": [str(p) for p in users], "faked": {
                "what": "libcuda.so.1", "calls": None,
                "as": f"a stand-in exporting {len(symbols)} driver functions, each returning CUDA_ERROR_NO_DEVICE"}}


def _missing(exc: BaseException) -> str:
    """What the failed import lacked, as precisely as the exception says."""
    if isinstance(exc, metadata.PackageNotFoundError):  # a version check (transformers has one)
        m = re.search(r"The '([^'<>=!~ ]+)", str(exc))
        return f"distribution {m.group(1) if m else exc.name}"
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return f"module {exc.name}"
    text = str(exc)
    for pattern in (r"cannot import name '([^']+)' from '([^']+)'", r"([\w.+-]+\.so[\w.]*): cannot open shared object",
                    r"undefined symbol: (\S+)"):
        m = re.search(pattern, text)
        if m:
            return " from ".join(m.groups())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def _failure(exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)
    return {"error": f"{type(exc).__name__}: {str(exc)[:2000]}", "missing": _missing(exc),
            "raised_at": [f"{f.filename}:{f.lineno}" for f in frames[-4:]]}


def import_steps() -> list[dict]:
    """The steps up to the first failure: a failed import leaves sglang half imported, and the steps
    after it would fail for the same reason or for that one."""
    results = []
    for module, role in STEPS:
        t = time.perf_counter()
        row = {"module": module, "role": role}
        try:
            importlib.import_module(module)
            row["ok"] = True
        except BaseException as exc:  # a C extension may raise SystemError or worse
            row.update(ok=False, **_failure(exc))
        row["seconds"] = round(time.perf_counter() - t, 3)
        results.append(row)
        if not row["ok"]:
            break
    return results


def build_server_args(model: Path) -> dict:
    """sglang's ServerArgs from our GPU engine's arguments (engine 0 on GPU 0) and the chosen backends."""
    t = time.perf_counter()
    try:
        from sglang.srt.server_args import ServerArgs

        from rollpacker.rollout.config import RolloutConfig
        from rollpacker.rollout.sglang_args import server_args

        kwargs = dict(server_args(model, RolloutConfig(backend="sglang"), tp_size=1, local_rank=0, gpu_id=0,
                                  engine_id=0, device="cuda"), **BACKENDS)
        args = ServerArgs(**kwargs)
        out = {"ok": True, "kwargs": {k: str(v) for k, v in kwargs.items()},
               "resolved": {k: str(getattr(args, k)) for k in ("attention_backend", "sampling_backend", "device",
                                                              "dtype", "mem_fraction_static", "chunked_prefill_size",
                                                              "disable_cuda_graph", "enable_memory_saver")}}
    except BaseException as exc:
        out = {"ok": False, **_failure(exc)}
    out["seconds"] = round(time.perf_counter() - t, 3)
    return out


def loaded_libraries(roots: list[str]) -> list[str]:
    """Shared libraries mapped into this process from under ``roots`` (the bundle's folders)."""
    paths = {line.split(None, 5)[5] for line in Path("/proc/self/maps").read_text().splitlines()
             if len(line.split(None, 5)) == 6}
    return sorted(p for p in paths if ".so" in p and any(p.startswith(r) for r in roots))


def _versions(names: list[str]) -> dict[str, str | None]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run(fake_cuda: bool, model: Path) -> dict:
    started = time.perf_counter()
    import torch
    torch_s = time.perf_counter() - started
    from rollpacker.rollout.sglang_args import GPU_ENGINE_ENV

    os.environ.update(GPU_ENGINE_ENV)
    report: dict = {"python": sys.version.split()[0], "env": GPU_ENGINE_ENV, "fake_cuda": fake_cuda, "faked": [],
                    "torch_import_seconds": round(torch_s, 3)}
    if fake_cuda:
        recorder = _Recorder()
        fake_h100(recorder)
        report["faked"] = recorder.faked
        with tempfile.TemporaryDirectory(prefix="libcuda-standin-") as tmp:  # loaded, the file may go
            report["driver"] = driver_standin(Path(tmp))
        if "faked" in report["driver"]:
            report["faked"].append(report["driver"].pop("faked"))
    else:
        report["device"] = {"name": torch.cuda.get_device_name(0), "capability": torch.cuda.get_device_capability(0)}
    skipped_models: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: skipped_models.append(record.getMessage())
    logging.getLogger(REGISTRY_LOGGER).addHandler(handler)
    report["steps"] = import_steps()
    logging.getLogger(REGISTRY_LOGGER).removeHandler(handler)
    report["not_reached"] = [m for m, _ in STEPS[len(report["steps"]):]]
    failed = next((s for s in report["steps"] if not s["ok"]), None)
    report["first_failure"] = failed
    report["server_args"] = None if failed else build_server_args(model)
    registry = sys.modules.get("sglang.srt.models.registry")
    report["model_registry"] = {
        "Qwen2ForCausalLM": bool(registry and "Qwen2ForCausalLM" in registry.ModelRegistry.models),
        "models": len(registry.ModelRegistry.models) if registry else 0,
        "skipped": skipped_models,
    }
    sgl_kernel = sys.modules.get("sgl_kernel")
    report["sgl_kernel_common_ops"] = getattr(getattr(sgl_kernel, "common_ops", None), "__file__", None)
    roots = sorted({str(Path(m.__file__).resolve().parents[1]) for m in (sys.modules.get("sglang"), sgl_kernel)
                    if m is not None and getattr(m, "__file__", None)})
    report["loaded_libraries"] = loaded_libraries(roots)
    report["versions"] = _versions(["sglang", "sglang-kernel", "torch", "triton", "transformers", "tokenizers",
                                    "numpy", "safetensors", "huggingface-hub", "flashinfer-python", "xgrammar"])
    report["ok"] = not failed and report["server_args"]["ok"] and report["model_registry"]["Qwen2ForCausalLM"]
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def summary(report: dict) -> str:
    lines = [f"sglang {report['versions'].get('sglang')} on torch {report['versions'].get('torch')}, "
             f"python {report['python']}{' (faked CUDA)' if report['fake_cuda'] else ''}"]
    for f in report["faked"]:
        calls = "" if f["calls"] is None else f" (called {f['calls']}x)"
        lines.append(f"  faked {f['what']} -> {f['as']}{calls}")
    if driver := report.get("driver"):
        exports = f"; exports {', '.join(driver['symbols'])}" if driver.get("symbols") else ""
        lines.append(f"  libcuda.so.1: {driver['libcuda.so.1']}{exports}")
    for s in report["steps"]:
        status = "ok" if s["ok"] else f"FAILED: {s['missing']}  [{s['error'][:300]}]"
        lines.append(f"  {s['seconds']:7.2f} s  {s['module']}: {status}")
    if report["not_reached"]:
        lines.append(f"  not reached: {', '.join(report['not_reached'])}, ServerArgs")
    if sa := report["server_args"]:
        lines.append(f"  {sa['seconds']:7.2f} s  ServerArgs: " + ("ok " + json.dumps(sa["resolved"]) if sa["ok"]
                                                               else f"FAILED: {sa['missing']}  [{sa['error'][:300]}]"))
    reg = report["model_registry"]
    lines.append(f"  model registry: {reg['models']} architectures, Qwen2ForCausalLM "
                 f"{'registered' if reg['Qwen2ForCausalLM'] else 'MISSING'}, {len(reg['skipped'])} modules skipped")
    lines.append(f"  sgl_kernel common_ops: {report['sgl_kernel_common_ops']}")
    lines.append(f"  {len(report['loaded_libraries'])} shared libraries loaded from the bundle")
    lines.append(f"{'OK' if report['ok'] else 'FAILED'} in {report['seconds']:.1f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fake-cuda", action="store_true", help="answer as one H100 where this machine has none")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--model", default=str(MODEL), help="the model directory ServerArgs reads (default: the policy)")
    a = p.parse_args(argv)
    report = run(a.fake_cuda, Path(a.model))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    print(summary(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
