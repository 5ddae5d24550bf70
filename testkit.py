"""What the tests and the benchmarks share: small deterministic checkpoints (never downloaded),
subprocess runs that leave nothing behind, and a free SGLang base port. Not part of the package."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from rollpacker.configlib import ConfigError
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.sglang_args import engine_ports

REPO_ROOT = Path(__file__).resolve().parent


# Per family: the transformers classes and the defaults of its random checkpoints.
_RANDOM_FAMILIES = {
    # GQA (4 heads, 2 KV heads), QKV bias, untied embeddings, a vocab of 250 (not divisible by 2
    # or 4, to exercise vocab padding).
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=250, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, torch_dtype="float32")),
    # The same, but no QKV bias, q/k norms and head_dim 32 != hidden 64 / 4 heads (as Qwen3-0.6B's
    # 128 != 1024 / 16).
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=250, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, torch_dtype="float32")),
    # Qwen3's attention; 8 experts of width 32, top-2 renormalised, the middle layer of 3 dense
    # (mlp_only_layers) so that both kinds of layer are converted and run.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=250, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], router_aux_loss_coef=0.001, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")),
}


def make_random_checkpoint(path: str | Path, family: str, *, seed: int = 0, **overrides) -> Path:
    """Write a random HF checkpoint (config.json + model.safetensors) of ``family`` to ``path``.

    ``overrides``: config keys over the family's defaults (:data:`_RANDOM_FAMILIES`).
    Biases and norm weights (which HF initialises to 0 and 1) get noise, so that parity
    checks would see them mis-loaded; a router's weights are scaled up, so that its top-k choices
    are clear of near-ties that rounding alone could flip between implementations.
    """
    import torch
    import transformers

    config_cls, model_cls, defaults = _RANDOM_FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**defaults, **overrides})
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_router_topk(model, ids: list[int], moe_layers: Sequence[int], top_k: int):
    """transformers' Qwen3-MoE routing of ``ids``: the top-k experts [positions, sparse layers, k] in
    descending weight, from each sparse layer's router input (hooked) and weight, by HF's formula (a
    softmax in fp32, then top-k): the same whatever the installed transformers' router returns."""
    import torch

    gates = [model.model.layers[i].mlp.gate for i in moe_layers]
    inputs: list = []
    hooks = [g.register_forward_hook(lambda _m, args, _out: inputs.append(args[0])) for g in gates]
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=model.device))
    finally:
        for h in hooks:
            h.remove()
    logits = [torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(), g.weight.float()) for x, g in zip(inputs, gates)]
    return torch.stack([torch.topk(torch.softmax(z, dim=-1), top_k, dim=-1).indices for z in logits], 1).cpu()


def make_random_qwen2(path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """A random Qwen2 checkpoint (see :func:`make_random_checkpoint`)."""
    return make_random_checkpoint(path, "qwen2", seed=seed, **overrides)


def make_random_qwen3(path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """A random Qwen3 dense checkpoint (see :func:`make_random_checkpoint`)."""
    return make_random_checkpoint(path, "qwen3", seed=seed, **overrides)


def make_random_qwen3_moe(path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """A random Qwen3-MoE checkpoint (see :func:`make_random_checkpoint`)."""
    return make_random_checkpoint(path, "qwen3_moe", seed=seed, **overrides)


def run_in_session(cmd: list[str], *, timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=timeout, ...)`` in a session of its own whose process group is killed
    however the run ends (a timeout or an interrupt included), so that a launcher's workers never outlive it."""
    with subprocess.Popen(cmd, start_new_session=True, **popen_kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            kill_group(proc.pid)
            exc.output, exc.stderr = proc.communicate()
            raise
        finally:
            kill_group(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def kill_group(pgid: int) -> None:
    """SIGKILL the process group ``pgid`` (a session this process started), if anything is left in it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_torchrun(nproc: int, args: list[str], *, timeout: float = 600, env: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node nproc ARGS`` (gloo, one thread per rank) from the repo root."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = run_in_session(cmd, timeout=timeout, cwd=REPO_ROOT, env=full_env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def free_base_port(*tps: int, local_ranks: int = 1) -> int:
    """An ``rollout.sglang_base_port`` that the config accepts and whose engine ports for TP sizes
    ``tps`` and node-local ranks ``0..local_ranks-1`` are free now: for runs that share a machine
    with others (tests, acceptance checks), where the fixed default could collide."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            RolloutConfig(backend="sglang", sglang_base_port=base).validate()
            for port in [p for rank in range(local_ranks) for tp in tps for p in engine_ports(base, rank, tp)]:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except (ConfigError, OSError):
            continue
        return base
    raise RuntimeError("no free sglang base port found in 100 tries")
