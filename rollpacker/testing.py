"""Small, deterministic artefacts for tests and benchmarks (never downloaded)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def make_random_qwen2(path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """Write a random Qwen2 HF checkpoint (config.json + model.safetensors) to ``path``.

    Defaults: GQA (4 heads, 2 KV heads), QKV bias, untied embeddings, a vocab
    of 250 (not divisible by 2 or 4, to exercise vocab padding).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = dict(vocab_size=250, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
               torch_dtype="float32")
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).float()
    with torch.no_grad():  # HF init leaves biases at zero; make them matter for parity
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def run_torchrun(nproc: int, args: list[str], *, timeout: float = 600, env: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node nproc ARGS`` (gloo, one thread per rank) from the repo root."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc
