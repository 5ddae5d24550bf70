"""The part of sglang (pinned 0.5.23) the SGLang backend touches, and its translation of our types.

``SGLANG_API`` lists every sglang method and keyword the backend calls; ``SGLangCalls`` is the only
door to the engine and refuses anything outside that table, and ``tests/test_sglang_backend.py``
checks the table against the source of the pinned wheel.
"""
from __future__ import annotations

import time
from typing import Any

from rollpacker.rollout.engine import Completion, SamplingParams

SGLANG_VERSION = "0.5.23"
# torchrun's c10d rendezvous sets this in its workers; see ``sglang_host.host_env``.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
LOAD_TIMEOUT_S = 30.0  # one load-snapshot read (a shared-memory read on the engine's loop)

# The whole SGLang surface this backend touches: "Class.method" -> keywords it passes.
# ``Engine.__init__`` keywords are ServerArgs fields.
SGLANG_API: dict[str, tuple[str, ...]] = {
    "Engine.__init__": ("model_path", "tp_size", "base_gpu_id", "port", "nccl_port", "enable_memory_saver",
                        "mem_fraction_static", "max_running_requests", "skip_tokenizer_init", "random_seed",
                        # a CPU engine (``sglang_args.server_args``)
                        "device", "attention_backend", "sampling_backend", "disable_cuda_graph",
                        "max_total_tokens", "dtype", "skip_server_warmup"),
    "Engine.get_server_info": (),
    "Engine.async_generate": ("input_ids", "sampling_params", "return_logprob", "rid"),
    "Engine.release_memory_occupation": ("tags",),
    "Engine.resume_memory_occupation": ("tags",),
    "Engine.begin_weight_update": (),
    "Engine.update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
    "Engine.end_weight_update": (),
    "Engine.shutdown": (),
    "TokenizerManager.abort_request": ("rid", "abort_all"),
    "TokenizerManager.get_loads": (),
}
SGLANG_ENGINE_ATTRIBUTES = ("loop", "tokenizer_manager")  # set by Engine.__init__
SGLANG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed",
                        "ignore_eos")
SGLANG_OUTPUT_KEYS = ("meta_info", "finish_reason", "output_token_logprobs", "num_retractions")
SGLANG_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


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


class SGLangCalls:
    """The only door to the SGLang engine: refuses calls outside ``SGLANG_API``."""

    def __init__(self, engine: Any):
        self.engine = engine

    @staticmethod
    def check(qualname: str, kwargs: dict[str, Any]) -> None:
        allowed = SGLANG_API.get(qualname)
        if allowed is None or set(kwargs) - set(allowed):
            raise AssertionError(f"{qualname}({', '.join(kwargs)}) is not in SGLANG_API; add it there so the "
                                 f"contract test checks it against sglang=={SGLANG_VERSION}")

    def __call__(self, qualname: str, **kwargs: Any) -> Any:
        self.check(qualname, kwargs)
        owner, method = qualname.split(".")
        target = self.engine.tokenizer_manager if owner == "TokenizerManager" else self.engine
        return getattr(target, method)(**kwargs)
