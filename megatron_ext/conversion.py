"""Qwen2/Qwen3 checkpoint conversion between HF safetensors and per-rank Megatron shards, and the
log-prob parity check of the two; the CLI is ``megatron_ext.convert``.

mcore format (a per-rank ``torch.save`` of the sharded state dict)::

    MCORE_DIR/mcore.json                       {"format": 1, "tp": .., "pp": .., "dtype": "fp32"|"bf16"}
    MCORE_DIR/config.json                      the HF config the model was built from
    MCORE_DIR/mp_rank_{tp:02d}_{pp:03d}/model.pt   {"model": GPTModel.state_dict()} of that shard
    + the source's tokenizer files

``mcore-to-hf`` must run with the tp*pp it was saved with.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_ext.logprobs import token_entropy, token_logprobs
from megatron_ext.parallel import ParallelLayout, setup_layout, teardown_layout
from megatron_ext.model import QwenModel, build_model
from rollpacker.hf_spec import load_hf_config, parse_spec
from megatron_ext.weights import copy_tokenizer_files, load_hf_checkpoint, save_hf_checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MCORE_FORMAT = 1


@dataclass(frozen=True)
class Parity:
    logprob_diff: float  # max |log p_megatron - log p_hf| over the batch
    entropy_diff: float  # max |H_megatron - H_hf|


def _build(hf_config: str | Path | dict, layout: ParallelLayout, params_dtype: torch.dtype) -> QwenModel:
    return build_model(hf_config, params_dtype=params_dtype, pre_process=layout.is_first_stage,
                       post_process=layout.is_last_stage, pg_collection=layout.pg_collection).to(layout.device)


def fixed_batch(vocab_size: int, *, batch_size: int = 2, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    """Token ids for parity checks, the same on every rank; includes the last vocabulary id."""
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))
    ids[0, -2] = vocab_size - 1
    return ids


@torch.no_grad()
def verify(hf_dir: str | Path, layout: ParallelLayout, *, params_dtype: torch.dtype = torch.float32) -> Parity:
    """Compare Megatron (this layout, PP=1) with transformers on :func:`fixed_batch`.

    Collective over the layout; the writer rank runs the HF reference and every
    rank returns the same numbers.
    """
    from transformers import AutoModelForCausalLM

    if layout.pp != 1:
        raise ValueError(f"verify runs one forward pass per rank and needs pp=1, got pp={layout.pp}")
    spec = parse_spec(hf_dir)
    ids = fixed_batch(spec.vocab_size).to(layout.device)
    labels = ids[:, 1:]
    positions = torch.arange(ids.shape[1], device=layout.device).expand_as(ids)
    model = _build(hf_dir, layout, params_dtype)
    load_hf_checkpoint(model, hf_dir)
    model.eval()
    logits = model(ids, positions, attention_mask=None)[:, :-1]  # causal mask built by Megatron
    ours = (token_logprobs(logits, labels, layout.tp_group, vocab_size=spec.vocab_size),
            token_entropy(logits, layout.tp_group, vocab_size=spec.vocab_size))
    del model, logits
    diffs = torch.zeros(2, dtype=torch.float64, device=layout.device)
    if layout.is_writer:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=params_dtype, attn_implementation="eager")
        log_p = torch.log_softmax(hf.to(layout.device)(ids).logits[:, :-1].float(), dim=-1)
        ref = (log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1))
        diffs = torch.stack([(a - b).abs().max().double() for a, b in zip(ours, ref)])
    dist.broadcast(diffs, src=0)
    return Parity(logprob_diff=diffs[0].item(), entropy_diff=diffs[1].item())


def _shard_file(mcore_dir: Path, layout: ParallelLayout) -> Path:
    return mcore_dir / f"mp_rank_{layout.tp_rank:02d}_{layout.pp_rank:03d}" / "model.pt"


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, layout: ParallelLayout, *, dtype: str = "fp32") -> None:
    """Write the mcore format (see the module docstring) for this layout's TP/PP sharding."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    model = _build(hf_dir, layout, DTYPES[dtype])
    load_hf_checkpoint(model, hf_dir)
    if layout.dp_rank == 0 and layout.cp_rank == 0:  # replicas hold identical shards
        path = _shard_file(out_dir, layout)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict()}, path)
    if layout.is_writer:
        meta = {"format": MCORE_FORMAT, "tp": layout.tp, "pp": layout.pp, "dtype": dtype}
        (out_dir / "mcore.json").write_text(json.dumps(meta, indent=2) + "\n")
        (out_dir / "config.json").write_text(json.dumps(load_hf_config(hf_dir), indent=2) + "\n")
        copy_tokenizer_files(hf_dir, out_dir)
    dist.barrier()


def read_mcore_meta(mcore_dir: str | Path) -> dict:
    path = Path(mcore_dir) / "mcore.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {mcore_dir} is not an mcore checkpoint from hf-to-mcore")
    meta = json.loads(path.read_text())
    if meta.get("format") != MCORE_FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, this version reads format {MCORE_FORMAT}")
    return meta


def mcore_to_hf(mcore_dir: str | Path, out_dir: str | Path, layout: ParallelLayout) -> None:
    """Rebuild the model from the mcore format on this layout and write an HF checkpoint."""
    mcore_dir = Path(mcore_dir)
    meta = read_mcore_meta(mcore_dir)
    if (meta["tp"], meta["pp"]) != (layout.tp, layout.pp):
        raise ValueError(f"{mcore_dir} was saved at tp={meta['tp']}, pp={meta['pp']}; "
                         f"convert it on that layout (torchrun --nproc_per_node {meta['tp'] * meta['pp']})")
    model = _build(mcore_dir, layout, DTYPES[meta["dtype"]])
    state = torch.load(_shard_file(mcore_dir, layout), map_location=layout.device, weights_only=True)
    model.load_state_dict(state["model"])
    save_hf_checkpoint(model, layout, out_dir, hf_config=mcore_dir)
