"""The part of sglang the SGLang backend touches, per supported release, and its translation of our types.

Supported releases: ``SUPPORTED_SGLANG``. 0.5.23 is the pin (requirements-gpu.txt, the CPU test
venv); 0.5.17 is the newest release that pins torch 2.11.0, which is what a GPU host without a
package index may hold. ``SGLANG_API`` lists every sglang method and keyword the backend calls in
both; ``SURFACES`` holds, per release, everything in which they differ for the backend (each field
cites the source line of both). ``SGLangCalls`` is the only door to the engine and refuses anything
outside its release's table, and ``tests/integration/test_sglang_backend_procs.py`` checks each
release's surface against the source of that release's wheel.

The installed release is read once per process from its distribution metadata
(``installed_surface``), without importing sglang, and only where an engine is started (the engine
host process): an unsupported release is refused there by name.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from rollpacker.rollout.engine import Completion, SamplingParams

SUPPORTED_SGLANG = ("0.5.17", "0.5.23")
SGLANG_PIN = "0.5.23"  # requirements-gpu.txt; what an engine double stands for unless told otherwise
# torchrun's c10d rendezvous sets this in its workers; see ``sglang_host.host_env``.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
LOAD_TIMEOUT_S = 30.0  # one load-snapshot read (a shared-memory read on the engine's loop)

# What both releases offer alike: "Class.method" -> keywords the backend passes (checked against
# each release's wheel). ``Engine.__init__`` keywords are ServerArgs fields.
SGLANG_API: dict[str, tuple[str, ...]] = {
    "Engine.__init__": ("model_path", "tp_size", "base_gpu_id", "port", "nccl_port", "enable_memory_saver",
                        "mem_fraction_static", "max_running_requests", "skip_tokenizer_init", "random_seed",
                        "sleep_on_idle", "attention_backend", "sampling_backend", "enable_deterministic_inference",
                        "enable_return_routed_experts",
                        # a CPU engine (``sglang_args.server_args``)
                        "device", "disable_cuda_graph", "max_total_tokens", "dtype", "skip_server_warmup"),
    "Engine.get_server_info": (),
    "Engine.async_generate": ("input_ids", "sampling_params", "return_logprob", "rid", "stream",
                              "return_routed_experts"),
    "Engine.release_memory_occupation": ("tags",),
    "Engine.resume_memory_occupation": ("tags",),
    "Engine.update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
    "Engine.shutdown": (),
    "TokenizerManager.abort_request": ("rid", "abort_all"),
    "TokenizerManager.get_loads": (),
}
# The weight-update session's calls, where a release has one (``SGLangSurface.weight_session``).
SESSION_API: dict[str, tuple[str, ...]] = {"Engine.begin_weight_update": (), "Engine.end_weight_update": ()}
SGLANG_ENGINE_ATTRIBUTES = ("loop", "tokenizer_manager")  # set by Engine.__init__
SGLANG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed",
                        "ignore_eos")
SGLANG_OUTPUT_KEYS = ("meta_info", "finish_reason", "output_token_logprobs", "num_retractions", "completion_tokens",
                      "routed_experts")
SGLANG_LOAD_FIELDS = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")  # LoadSnapshot (get_loads)
SGLANG_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


class UnsupportedSGLangError(RuntimeError):
    """The installed sglang is not one of ``SUPPORTED_SGLANG``."""


@dataclass(frozen=True)
class SGLangSurface:
    """One supported sglang release as the backend sees it. Every field but ``version`` is a
    difference between the supported releases; paths are under ``sglang/srt/`` of each wheel."""

    version: str
    # The torch the wheel pins (``Requires-Dist: torch==``): 0.5.17 METADATA line 273, 0.5.23 line 281.
    torch: str
    # Pushes go inside ``Engine.begin_weight_update()`` / ``end_weight_update()``, and
    # ``update_weights_from_tensor`` outside one answers ``(False, "... must run between
    # begin_weight_update() and end_weight_update()")``.
    # 0.5.17: no session: the Engine has neither method, its update_weights_from_tensor
    #   (entrypoints/engine.py:1375) loads at once, and the scheduler checks no session
    #   (managers/scheduler_components/weight_updater.py:153);
    # 0.5.23: entrypoints/engine.py:1643 and :1650; the refusal is
    #   managers/scheduler_components/weight_updater.py:234-239.
    weight_session: bool
    # A push with ``flush_cache=True`` while the scheduler still runs or queues requests:
    # 0.5.17: the scheduler asserts the flush and dies (managers/scheduler_components/
    #   weight_updater.py:108, ``assert flush_cache_success``), so the driver first waits for an
    #   idle engine, as it does before a memory release;
    # 0.5.23: answered ``(False, "... cache was not flushed ...")``
    #   (managers/scheduler_components/weight_updater.py:125-133), which the driver raises.
    flush_needs_idle: bool
    # ``Engine._serialize_tensors_per_rank`` sizes a push for the TP size of the process's live
    # config rather than its own ``server_args``, so two engines in one process push for whichever
    # started last (one reason for ``sglang_host``'s process per engine; the others hold for both):
    # 0.5.17: ``self.server_args.tp_size`` (entrypoints/engine.py:1454; runtime_context.py:1283-1290
    #   asks per-engine code to read its own server_args);
    # 0.5.23: ``get_parallel().tp_size`` (entrypoints/engine.py:1758), a process holding "at most
    #   one live config" (runtime_context.py:1510) that Engine.__init__ publishes (engine.py:1175).
    process_wide_config: bool

    @property
    def api(self) -> dict[str, tuple[str, ...]]:
        """Every call the backend may make on this release."""
        return {**SGLANG_API, **(SESSION_API if self.weight_session else {})}


SURFACES: dict[str, SGLangSurface] = {s.version: s for s in (
    SGLangSurface("0.5.17", torch="2.11.0", weight_session=False, flush_needs_idle=True, process_wide_config=False),
    SGLangSurface("0.5.23", torch="2.14.1", weight_session=True, flush_needs_idle=False, process_wide_config=True),
)}
assert tuple(SURFACES) == SUPPORTED_SGLANG


def surface_for(version: str) -> SGLangSurface:
    """The surface of sglang ``version``; refuses a release the backend does not support."""
    try:
        return SURFACES[version]
    except KeyError:
        raise UnsupportedSGLangError(
            f"sglang {version} is installed, but the SGLang backend supports sglang "
            f"{' and '.join(SUPPORTED_SGLANG)} only (install sglang=={SGLANG_PIN}, the pin of "
            f"requirements-gpu.txt)") from None


@functools.lru_cache(maxsize=1)
def installed_surface() -> SGLangSurface:
    """The surface of the sglang installed for this interpreter, read once from its distribution
    metadata (sglang itself is not imported)."""
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise ModuleNotFoundError("No module named 'sglang': the sglang backend needs sglang "
                                  f"{' or '.join(SUPPORTED_SGLANG)} installed", name="sglang") from None
    return surface_for(version)


class WeightSyncError(RuntimeError):
    """SGLang refused part of a weight push: the engine must not serve rollouts from what it holds."""


def sampling_params(p: SamplingParams) -> dict[str, Any]:
    """sglang's sampling parameters; the seed is passed on but sglang ignores it here (module docstring)."""
    out = dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_new_tokens=p.max_new_tokens,
               stop_token_ids=list(p.stop_token_ids), ignore_eos=not p.stop_token_ids)
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


def completion(request_id: str, output: dict, submitted_at: float, engine_id: int) -> Completion:
    """Translate one ``async_generate`` result (``return_logprob=True``) into a ``Completion``."""
    meta = output["meta_info"]
    triples = meta["output_token_logprobs"]  # (logprob, token id, text or None) per output token
    return Completion(request_id=request_id, output_ids=[int(t) for _, t, _ in triples],
                      logprobs=[float(lp) for lp, _, _ in triples], finish_reason=meta["finish_reason"]["type"],
                      submitted_at=submitted_at, finished_at=time.monotonic(), engine_id=engine_id)


def check_call(surface: SGLangSurface, qualname: str, kwargs: dict[str, Any]) -> None:
    """Refuse a call outside ``surface.api``."""
    allowed = surface.api.get(qualname)
    if allowed is None or set(kwargs) - set(allowed):
        raise AssertionError(f"{qualname}({', '.join(kwargs)}) is not in the API of sglang {surface.version} "
                             f"(sglang_api.SGLANG_API, SESSION_API); add it there so the contract test checks "
                             f"it against that release")


class SGLangCalls:
    """The only door to the SGLang engine: refuses calls outside its release's ``surface.api``."""

    def __init__(self, engine: Any, surface: SGLangSurface):
        self.engine, self.surface = engine, surface

    def __call__(self, qualname: str, **kwargs: Any) -> Any:
        check_call(self.surface, qualname, kwargs)
        owner, method = qualname.split(".")
        target = self.engine.tokenizer_manager if owner == "TokenizerManager" else self.engine
        return getattr(target, method)(**kwargs)
