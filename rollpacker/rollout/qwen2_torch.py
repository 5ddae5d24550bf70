"""A compact Qwen2 forward in plain PyTorch over a paged KV cache, tensor-parallel over a process group.

Read from an HF safetensors directory (``config.json`` + ``*.safetensors``) without
instantiating a ``transformers`` model. Sharding is Megatron-style: QKV and
gate/up are column-parallel (each rank owns whole attention heads and a slice
of the MLP), o_proj and down_proj row-parallel, so each sub-block ends in ONE
all-reduce over ``group``. Embedding, norms and lm_head are replicated (they
are small next to the layers, and it lets the leader sample from full logits
with no gather). Every rank holds the KV of its own heads only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open

from rollpacker.hf_qwen2 import Qwen2Spec


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, tensor)`` from every ``*.safetensors`` file of a directory."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@dataclass(frozen=True)
class _Target:
    """Where one HF tensor goes: local parameter, row offset in it, and the split dim (None: replicated)."""
    local: str
    offset: int = 0
    split_dim: int | None = None


@dataclass
class ForwardPlan:
    """Everything a forward needs besides weights and KV; the leader broadcasts it to followers.

    ``kind == "prefill"``: right-padded ``input_ids`` [B, T], ``lengths`` [B]; KV of the
    valid tokens is written at (``write_pages``, ``write_offsets``) in row-major order.
    ``kind == "decode"``: ``input_ids`` [B, 1]; ``lengths`` [B] counts the KV including the
    token written now; keys are read through ``block_table`` [B, max pages].
    """
    kind: str
    input_ids: torch.Tensor
    lengths: torch.Tensor
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    block_table: torch.Tensor | None = None


class PagedKV:
    """K and V pools of shape [layers, local KV heads, pages, page size, head dim].

    Head-major pages make the gathered keys of a decode step one contiguous
    [rows, heads, tokens, dim] tensor, the layout attention reads, from a single
    embedding lookup (the fastest gather on CPU) per pool and layer.
    """

    def __init__(self, layers: int, pages: int, kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (layers, kv_heads, pages, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pages, self.page_size, self.kv_heads = pages, page_size, kv_heads

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store tokens ``k``, ``v`` [N, heads, dim] at (``pages``, ``offsets``) [N]."""
        self.k[layer][:, pages, offsets] = k.transpose(0, 1)
        self.v[layer][:, pages, offsets] = v.transpose(0, 1)

    def lookup_index(self, block_table: torch.Tensor) -> torch.Tensor:
        """Rows of the [heads * pages, page * dim] view that hold each row's pages, per head."""
        heads = torch.arange(self.kv_heads, device=block_table.device) * self.pages
        return heads.view(1, -1, 1) + block_table.unsqueeze(1)  # [B, heads, pages per row]

    def read(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, heads, pages per row * page, dim] of the rows in ``index``."""
        def gather(pool: torch.Tensor) -> torch.Tensor:
            rows = F.embedding(index, pool.view(self.kv_heads * self.pages, -1))
            return rows.view(index.shape[0], self.kv_heads, -1, pool.shape[-1])
        return gather(self.k[layer]), gather(self.v[layer])


class Qwen2TP:
    """One tensor-parallel shard of a Qwen2 model (the whole model when ``tp_size == 1``)."""

    def __init__(self, spec: Qwen2Spec, *, tp_rank: int = 0, tp_size: int = 1,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if spec.num_heads % tp_size or spec.num_kv_heads % tp_size or spec.intermediate_size % tp_size:
            raise ValueError(f"TP size {tp_size} must divide the attention heads ({spec.num_heads}), KV heads "
                             f"({spec.num_kv_heads}) and intermediate size ({spec.intermediate_size})")
        self.spec, self.tp_rank, self.tp_size, self.group = spec, tp_rank, tp_size, group
        self.dtype, self.device = dtype, torch.device(device)
        self.heads = spec.num_heads // tp_size
        self.kv_heads = spec.num_kv_heads // tp_size
        self.ffn = spec.intermediate_size // tp_size
        self._shapes, self._targets = self._layout()
        self.params: dict[str, torch.Tensor] = {}
        inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim)
        self._inv_freq = inv_freq.float().to(self.device)

    # ---- weights -------------------------------------------------------------------------------
    def _layout(self) -> tuple[dict[str, tuple[int, ...]], dict[str, _Target]]:
        s, d = self.spec, self.spec.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        shapes: dict[str, tuple[int, ...]] = {"embed": (s.vocab_size, s.hidden_size), "norm": (s.hidden_size,)}
        targets = {"model.embed_tokens.weight": _Target("embed"), "model.norm.weight": _Target("norm")}
        if s.tie_word_embeddings:
            targets["lm_head.weight"] = _Target("embed")  # some tied checkpoints still carry it
        else:
            shapes["lm_head"] = (s.vocab_size, s.hidden_size)
            targets["lm_head.weight"] = _Target("lm_head")
        for i in range(s.num_layers):
            p, hf = f"{i}.", f"model.layers.{i}."
            shapes.update({p + "ln1": (s.hidden_size,), p + "ln2": (s.hidden_size,),
                           p + "qkv_w": (q + 2 * kv, s.hidden_size), p + "qkv_b": (q + 2 * kv,),
                           p + "o": (s.hidden_size, q), p + "gate_up": (2 * self.ffn, s.hidden_size),
                           p + "down": (s.hidden_size, self.ffn)})
            targets.update({
                hf + "input_layernorm.weight": _Target(p + "ln1"),
                hf + "post_attention_layernorm.weight": _Target(p + "ln2"),
                hf + "self_attn.q_proj.weight": _Target(p + "qkv_w", 0, 0),
                hf + "self_attn.k_proj.weight": _Target(p + "qkv_w", q, 0),
                hf + "self_attn.v_proj.weight": _Target(p + "qkv_w", q + kv, 0),
                hf + "self_attn.q_proj.bias": _Target(p + "qkv_b", 0, 0),
                hf + "self_attn.k_proj.bias": _Target(p + "qkv_b", q, 0),
                hf + "self_attn.v_proj.bias": _Target(p + "qkv_b", q + kv, 0),
                hf + "self_attn.o_proj.weight": _Target(p + "o", 0, 1),
                hf + "mlp.gate_proj.weight": _Target(p + "gate_up", 0, 0),
                hf + "mlp.up_proj.weight": _Target(p + "gate_up", self.ffn, 0),
                hf + "mlp.down_proj.weight": _Target(p + "down", 0, 1)})
        return shapes, targets

    def hf_names(self) -> list[str]:
        """The HF names a full load must provide (``lm_head.weight`` is optional when tied)."""
        return [n for n in self._targets if not (self.spec.tie_word_embeddings and n == "lm_head.weight")]

    def has_weight(self, name: str) -> bool:
        return name in self._targets

    @property
    def allocated(self) -> bool:
        return bool(self.params)

    def allocate(self) -> None:
        """Allocate (uninitialised) parameter storage; values come from ``load``."""
        self.params = {k: torch.empty(v, dtype=self.dtype, device=self.device) for k, v in self._shapes.items()}

    def release(self) -> None:
        self.params = {}

    def _slot(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(where this rank keeps its shard of the full HF tensor ``name``, that shard)."""
        target = self._targets.get(name)
        if target is None:
            raise KeyError(f"unknown Qwen2 weight name {name!r}")
        if target.split_dim is not None:
            if tensor.shape[target.split_dim] % self.tp_size:
                raise ValueError(f"{name}: dim {target.split_dim} of shape {tuple(tensor.shape)} "
                                 f"is not divisible by TP size {self.tp_size}")
            tensor = tensor.chunk(self.tp_size, target.split_dim)[self.tp_rank]
        dest = self.params[target.local].narrow(0, target.offset, tensor.shape[0])
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: got shape {tuple(tensor.shape)} for this rank's shard, "
                             f"expected {tuple(dest.shape)}")
        return dest, tensor

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's shard of the full HF tensor ``name`` into place."""
        dest, shard = self._slot(name, tensor)
        dest.copy_(shard)

    @torch.no_grad()
    def shard_diff(self, name: str, tensor: torch.Tensor) -> float:
        """max |stored shard - this rank's shard of the full tensor ``name``|."""
        dest, shard = self._slot(name, tensor)
        return float((dest.float() - shard.float()).abs().max()) if shard.numel() else 0.0

    def load_all(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen = set()
        for name, tensor in named_tensors:
            self.load(name, tensor)
            seen.add(name)
        missing = sorted(set(self.hf_names()) - seen)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    def new_kv(self, pages: int, page_size: int) -> PagedKV:
        return PagedKV(self.spec.num_layers, pages, self.kv_heads, page_size, self.spec.head_dim,
                       self.dtype, self.device)

    # ---- forward -------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return w * xf.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.unsqueeze(-1).float() * self._inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [B, T, 1, D]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    @torch.no_grad()
    def forward(self, plan: ForwardPlan, kv: PagedKV) -> torch.Tensor:
        """Run the layers, write KV, and return the final hidden state of each row's last token."""
        s, p, d = self.spec, self.params, self.spec.head_dim
        ids = plan.input_ids.to(self.device)
        lengths = plan.lengths.to(self.device)
        bsz, t = ids.shape
        if plan.kind == "prefill":
            positions = torch.arange(t, device=self.device).expand(bsz, t)
            valid = positions < lengths.unsqueeze(1)
        else:
            positions = (lengths - 1).unsqueeze(1)
            valid = None
            index = kv.lookup_index(plan.block_table.to(self.device))
            key_mask = (torch.arange(index.shape[2] * kv.page_size, device=self.device)
                        < lengths.unsqueeze(1)).view(bsz, 1, 1, -1)
        pages, offsets = plan.write_pages.to(self.device), plan.write_offsets.to(self.device)
        cos, sin = self._rope(positions)
        q_size, kv_size = self.heads * d, self.kv_heads * d
        x = p["embed"][ids]
        for i in range(s.num_layers):
            h = self._rms(x, p[f"{i}.ln1"])
            qkv = F.linear(h, p[f"{i}.qkv_w"], p[f"{i}.qkv_b"])
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = self._rotate(q.view(bsz, t, self.heads, d), cos, sin)
            k = self._rotate(k.view(bsz, t, self.kv_heads, d), cos, sin)
            v = v.view(bsz, t, self.kv_heads, d)
            if valid is not None:  # prefill: attend within the new tokens, store them
                kv.write(i, pages, offsets, k[valid], v[valid])
                attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True, enable_gqa=True)
            else:  # decode: store the one new token, attend over the row's pages
                kv.write(i, pages, offsets, k[:, 0], v[:, 0])
                keys, values = kv.read(i, index)
                attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=key_mask,
                                                      enable_gqa=True)
            x = x + self._reduce(F.linear(attn.transpose(1, 2).reshape(bsz, t, q_size), p[f"{i}.o"]))
            gate, up = F.linear(self._rms(x, p[f"{i}.ln2"]), p[f"{i}.gate_up"]).chunk(2, dim=-1)
            x = x + self._reduce(F.linear(F.silu(gate) * up, p[f"{i}.down"]))
        return x[torch.arange(bsz, device=self.device), lengths - 1] if valid is not None else x[:, 0]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.params["embed" if self.spec.tie_word_embeddings else "lm_head"]
        return F.linear(self._rms(hidden, self.params["norm"]), head).float()
