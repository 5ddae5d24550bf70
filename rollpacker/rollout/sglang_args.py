"""``sglang.Engine`` arguments of the SGLang backend: ports per (local rank, TP) and the server
arguments for a GPU or a CPU engine (sglang 0.5.17 and 0.5.23 take the same ones: ``sglang_api.SGLANG_API``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from rollpacker.hf_spec import parse_spec
from rollpacker.rollout.config import (SGLANG_LAYOUT_SLOTS, SGLANG_MAX_LOCAL_RANKS, SGLANG_MAX_TP_BITS,
                                       SGLANG_PORT_BLOCK, RolloutConfig)

# The dtype a CPU engine computes in unless the caller names one: sglang's default ("auto", the
# checkpoint's dtype) would serve a bf16 checkpoint in bf16, which CPUs compute slowly and which
# departs from the fp32 trainer and reference engine on CPU.
CPU_DTYPE = "float32"


def engine_ports(base_port: int, local_rank: int, tp_size: int, ep_size: int = 1) -> tuple[int, int]:
    """``(port, nccl_port)`` of the TP-``tp_size``, EP-``ep_size`` engine led by node-local rank ``local_rank``.

    One rank leads engines of several layouts (``EngineSets``), and sglang's TP-rank-0 scheduler
    binds a TCPStore on ``nccl_port``: a port per rank alone would make the second engine's bind
    fail, and sglang then SIGQUITs the rank. So each (local rank, TP size, EP size) gets its own block
    of ``SGLANG_PORT_BLOCK`` ports; all blocks of a node lie in ``[base, base + SGLANG_PORT_SPAN)``,
    which ``RolloutConfig.validate`` keeps clear of the rendezvous ports. Nodes do not share ports,
    so the global rank plays no part.
    """
    if tp_size < 1 or tp_size & (tp_size - 1) or tp_size.bit_length() > SGLANG_MAX_TP_BITS:
        raise ValueError(f"sglang engine TP size must be a power of two <= {1 << (SGLANG_MAX_TP_BITS - 1)}, "
                         f"got {tp_size}")
    if ep_size < 1 or ep_size & (ep_size - 1) or tp_size % ep_size:
        raise ValueError(f"sglang engine EP size must be a power of two dividing the TP size {tp_size}, got {ep_size}")
    if not 0 <= local_rank < SGLANG_MAX_LOCAL_RANKS:
        raise ValueError(f"local rank {local_rank} is outside the {SGLANG_MAX_LOCAL_RANKS} ranks per node "
                         f"that the sglang port layout provides for")
    k = tp_size.bit_length() - 1  # TP 2**k takes slots k(k+1)/2 .. k(k+1)/2 + k, one per EP 1 .. 2**k
    slot = local_rank * SGLANG_LAYOUT_SLOTS + k * (k + 1) // 2 + ep_size.bit_length() - 1
    port = base_port + SGLANG_PORT_BLOCK * slot
    return port, port + 1


def server_args(model_dir: str | Path, cfg: RolloutConfig, *, tp_size: int, local_rank: int,
                gpu_id: int | None = None, engine_id: int, device: str | torch.device = "cuda",
                dtype: str | None = None, ep_size: int = 1) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for the TP-``tp_size`` engine led by ``local_rank``, a MoE
    model's experts split over ``ep_size`` blocks of its ranks: sglang's ``ep_size`` (with no
    all-to-all backend the layout is ours: ``tp_size == moe_ep_size * moe_tp_size``, sglang 0.5.23
    ``srt/runtime_context.py:303-310``, every rank's partial output summed by the TP all-reduce).

    On a GPU (``device`` of type cuda) the engine starts at ``gpu_id`` with the attention and sampling
    backends of ``cfg`` (sglang's own choice where they are None or "auto") and CUDA graphs, its
    memory under the memory saver (release/resume) and its KV pool sized by ``mem_fraction_static``.
    On CPU (``device`` "cpu") it runs sglang's plain-torch path:
    - torch-native attention and the pytorch sampler: sglang's CPU defaults are the ``intel_amx``
      attention backend and ``sgl_kernel`` CPU ops, which a CPU build without AMX kernels lacks;
    - no CUDA graphs, and no memory saver: ``torch_memory_saver`` is CUDA-only, so release/resume
      keep the memory on CPU (they still pause and resume the engine);
    - no ``base_gpu_id``;
    - ``dtype`` (default ``CPU_DTYPE``, fp32);
    - a KV pool of ``cfg.kv_cache_tokens`` tokens (``max_total_tokens``), as the reference engine's,
      instead of a fraction of the host's memory;
    - no server warm-up request (the engine is driven in-process, no HTTP server to warm up);
    - no expert parallelism: sglang's plain-torch MoE (``layers/moe/fused_moe_native.py:77``, 0.5.23)
      scatters every chosen expert id into a count table, and EP marks another rank's expert -1.
    """
    port, nccl_port = engine_ports(cfg.sglang_base_port, local_rank, tp_size, ep_size)
    # sleep_on_idle: without it an idle scheduler spins, a CPU core per engine for the whole run
    # (``managers/scheduler_components/idle_sleeper.py``, ``IdleSleeper``: 0.5.17 line 35, 0.5.23
    # line 36), and the engines are idle whenever the trainer runs, on the cores the trainer, the
    # reward workers and the other engines of the node need. It waits in a poll on the scheduler's
    # input sockets, so a request wakes it at once.
    common = dict(model_path=str(model_dir), tp_size=tp_size, port=port, nccl_port=nccl_port,
                  mem_fraction_static=cfg.mem_fraction_static, max_running_requests=cfg.max_running_requests,
                  skip_tokenizer_init=True, random_seed=cfg.seed + engine_id, sleep_on_idle=True)
    if ep_size > 1:
        common["ep_size"] = ep_size
    if cfg.sglang_deterministic_inference:
        common["enable_deterministic_inference"] = True
    # each finished request's meta_info then carries "routed_experts"; a dense model routes nothing, and
    # sglang's capturer would read the experts per token its config lacks (state_capturer/routed_experts.py:72)
    if cfg.return_routing and parse_spec(model_dir).is_moe:
        common["enable_return_routed_experts"] = True
    kind = torch.device(device).type
    if kind == "cpu":
        if ep_size > 1:
            raise ValueError(f"an sglang engine on CPU cannot split experts (EP {ep_size}): its plain-torch MoE "
                             "indexes the -1 that marks another rank's expert (sglang layers/moe/"
                             "fused_moe_native.py:77); set rollout.ep=1 and scheduler.planner.short_ep/long_ep=1, "
                             "or rollout.backend=reference")
        return dict(common, device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                    disable_cuda_graph=True, enable_memory_saver=False, max_total_tokens=cfg.kv_cache_tokens,
                    dtype=dtype or CPU_DTYPE, skip_server_warmup=True)
    if kind != "cuda":
        raise ValueError(f"the sglang backend runs on cuda or cpu devices, got {device!r}")
    if gpu_id is None:
        raise ValueError("a GPU sglang engine needs gpu_id (its base_gpu_id)")
    out = dict(common, base_gpu_id=gpu_id, enable_memory_saver=True)
    for key, value in (("attention_backend", cfg.sglang_attention_backend),
                       ("sampling_backend", cfg.sglang_sampling_backend)):
        if value not in (None, "auto"):
            out[key] = value
    if dtype is not None:
        out["dtype"] = dtype
    return out


# Environment of a GPU engine's host process (``gpu_engine_env``), for sglang 0.5.17 as carried to a
# machine whose torch is held (docs/gpu/README.md), with the config's default kernels (triton
# attention, pytorch sampling); a full install may drop it.
GPU_ENGINE_ENV: dict[str, str] = {
    # flashinfer stays importable (sglang's engine path imports it) but its kernels are not used: the
    # carried 0.6.15.post1 has no prebuilt kernels (no flashinfer-cubin of that version) and would
    # JIT-compile them on a fresh machine. sglang 0.5.17 ``srt/utils/common.py:350-357``:
    # ``is_flashinfer_available`` is False when this is false, before it looks for the package.
    "SGLANG_IS_FLASHINFER_AVAILABLE": "false",
    # tvm_ffi (0.1.11, sglang 0.5.17's pin) loads a torch DLPack add-on at import unless this is set
    # (``tvm_ffi/_optional_torch_c_dlpack.py:206``), building it with the host's compiler when none is
    # cached (line 140), as on every fresh machine.
    "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",
    # triton (3.6.0, torch 2.11's) runs an fp32 ``tl.dot`` in TF32 unless this names a precision
    # (``triton/language/core.py:2024``, read via ``knobs.py:484``): an engine served in fp32 would
    # otherwise compute its attention in TF32.
    "TRITON_F32_DEFAULT": "ieee",
}


def gpu_engine_env() -> dict[str, str]:
    """``GPU_ENGINE_ENV`` less the variables the caller already set: a user's own value wins."""
    return {k: v for k, v in GPU_ENGINE_ENV.items() if k not in os.environ}


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def cpu_engine_env(tp_size: int, local_rank: int = 0, local_ranks: int = 1,
                   cpus: list[int] | None = None) -> dict[str, str]:
    """Environment a CPU engine of ``tp_size`` ranks, led by node-local rank ``local_rank`` of
    ``local_ranks``, needs while sglang spawns its schedulers.

    Unless ``SGLANG_CPU_OMP_THREADS_BIND`` is set, sglang gives each TP rank one NUMA node and asserts
    that there are as many nodes as ranks (``utils/numa_utils.py``, ``init_threads_binding``: 0.5.17
    line 441 ``tp_size <= n_numa_node``, 0.5.23 line 463 ``dp * tp * pp <= n_numa_node``), so a TP-2
    engine cannot start on a one-node host, and every engine of a node binds its threads to the same
    CPUs: L engines running at once (each rank's TP-1 engine in a short round) spin L threads per CPU.
    So, as each rank's GPU engine takes its own GPU, the CPUs the process may run on (``cpus``,
    default its affinity) are split into one slice per node-local rank, and each TP rank of the
    engine (node-local ranks ``local_rank .. local_rank + tp_size - 1``) binds to its own rank's
    slice: '|'-separated groups, one per TP rank, which both releases accept (0.5.17 line 458 wants
    exactly ``tp_size`` groups, 0.5.23 line 492 one per rank index); a rank shares a CPU when there
    are fewer CPUs than ranks. A lone engine gets all of the process's CPUs (sglang's default, a
    NUMA node, ignores the affinity that taskset or a scheduler's CPU binding gave the process). A
    value the caller set is left alone. With the variable set sglang does not size the KV pool from
    host memory (``utils/common.py``, ``get_cpu_memory_capacity``: 0.5.17 line 725, 0.5.23 line 913),
    which is why CPU engines always get ``max_total_tokens``.
    """
    if os.environ.get(THREADS_BIND_ENV):
        return {}
    slices = cpu_shares(max(local_ranks, local_rank + tp_size), cpus)
    return {THREADS_BIND_ENV: "|".join(_cpu_list(g) for g in slices[local_rank:local_rank + tp_size])}


def cpu_shares(n: int, cpus: list[int] | None = None) -> list[list[int]]:
    """``cpus`` (default: those this process may run on) split into ``n`` contiguous shares; with
    fewer CPUs than shares, a share reuses one CPU."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    return [cpus[i * len(cpus) // n:(i + 1) * len(cpus) // n] or [cpus[i % len(cpus)]] for i in range(n)]


def _cpu_list(cpus: list[int]) -> str:
    """"0-15" for a contiguous run (the form sglang's own examples use), else "0,2,5"."""
    if len(cpus) > 1 and cpus[-1] - cpus[0] == len(cpus) - 1:
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))
