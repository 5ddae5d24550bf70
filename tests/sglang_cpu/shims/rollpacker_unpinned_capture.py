"""Shim for sglang 0.5.23 on CPU: on a host without CUDA, allocate sglang's host buffers for device
"cpu" unpinned, so that an engine with ``enable_return_routed_experts`` starts.

Why: the routed-experts capturer keeps every KV slot's routing in a host buffer that it always asks
to be pinned (``srt/state_capturer/base.py:67-74``, ``BaseHostCache``: ``ALLOC_MEMORY_FUNCS[device]``
with ``pin_memory=True``, device "cpu" on a CPU engine). "cpu" has no entry in
``ALLOC_MEMORY_FUNCS`` (``srt/mem_cache/pool_host/common.py:453-460``), so it falls to
``alloc_with_host_register``, which pins with ``cudaHostRegister`` (``common.py:348-349`` ->
``_cuda_host_register``, line 147 ``torch.cuda.cudart()``); torch without CUDA raises there ("Torch
not compiled with CUDA enabled"), in the scheduler's model-runner set-up (``model_runner.py:
1222-1238``), and the engine dies at start. Nothing reads or sets the flag elsewhere: no server
argument or environment variable of sglang's turns the pinning off.

What it changes, and nothing else: once ``sglang.srt.mem_cache.pool_host.common`` is imported, if
torch has no CUDA and sglang gives device "cpu" no allocator of its own, ``ALLOC_MEMORY_FUNCS["cpu"]``
becomes ``alloc_with_host_register`` with ``pin_memory=False``: the same buffer (``alloc_mmap`` of
the same shape and dtype, zeroed by the capturer), not page-locked. Pinning only speeds copies to a
GPU, which a CPU engine has none of, and the unpinned buffer needs no unregistering (the capturer
unregisters only on CUDA or ROCm, ``base.py:85``). Where CUDA is available, or sglang gains a
"cpu" allocator, the shim leaves everything as it is. (sglang 0.5.17 pins the buffer with
``torch.zeros(..., pin_memory=True)`` instead, ``state_capturer/base.py:56-61`` of its wheel: not
covered here, its CPU venv does not report routing.)

Loaded by ``rollpacker_unpinned_capture.pth`` in every interpreter of the venv, including the
processes sglang spawns; at startup it only installs a ``sys.meta_path`` hook.
"""
import importlib.machinery
import sys

_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _unpinned(alloc):
    def alloc_unpinned(dims, dtype, device, pin_memory, allocator, *args, **kwargs):
        return alloc(dims, dtype, device, False, allocator, *args, **kwargs)

    alloc_unpinned.__name__ = alloc_unpinned.__qualname__ = f"{alloc.__name__}_unpinned"
    return alloc_unpinned


class _UnpinnedWithoutCuda:
    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch

            if not torch.cuda.is_available() and "cpu" not in module.ALLOC_MEMORY_FUNCS:
                module.ALLOC_MEMORY_FUNCS["cpu"] = _unpinned(module.alloc_with_host_register)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _UnpinnedWithoutCuda())
