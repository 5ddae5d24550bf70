"""Stub of ``sgl_kernel`` for sglang 0.5.23 on CPU.

Why: with ``SGLANG_USE_CPU_ENGINE=1`` sglang imports CPU kernel names from ``sgl_kernel`` at module
import time (``copy_all_layer_kv_cache_cpu``, ``assign_req_to_token_pool_cpu``, speculative and
mamba helpers). The real package (``sglang-kernel``) has CUDA builds only. None of those names is
called when serving a dense model with the ``torch_native`` attention backend, so here every name
resolves to a function that raises if it is ever called.

It deliberately registers no ``torch.ops.sgl_kernel`` operators: that keeps sglang's
``cpu_has_amx_support()`` False, so RMSNorm, SiluAndMul and rotary embedding take their plain-torch
``forward_native`` paths, which are what the tests compare against transformers.
"""


def __getattr__(name: str):
    if name.startswith("__"):  # keep introspection (copy, pickle, hasattr checks) honest
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is a stub (CPU test venv, no sglang-kernel build)")

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable
