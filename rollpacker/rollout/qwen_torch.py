"""A compact Qwen2/Qwen3/Qwen3-MoE forward in plain PyTorch over a paged KV cache, tensor-parallel over a process group.

Read from an HF safetensors directory (``config.json`` + ``*.safetensors``) without
instantiating a ``transformers`` model. Sharding is Megatron-style: QKV and
gate/up are column-parallel (each rank owns whole attention heads and a slice
of the MLP), o_proj and down_proj row-parallel, so each sub-block ends in ONE
all-reduce over ``group``. Embedding, norms and lm_head are replicated (they
are small next to the layers, and it lets the leader sample from full logits
with no gather), as are Qwen3's per-head q/k norms. Every rank holds the KV of
its own heads only.

Qwen3-MoE's sparse layers keep the router (``mlp.gate``) replicated, so every rank
routes every token alike. Expert parallelism (``ep_size``, dividing the TP size) splits
the experts into ``ep_size`` equal blocks of whole experts, one per run of ``tp_size /
ep_size`` ranks, and shards each expert over its run exactly as the dense MLP (gate/up
column-, down row-parallel); ``ep_size`` 1 shards every expert over every rank. A rank
computes its slice of each chosen expert it holds, and the one all-reduce after the MLP
over the whole TP group sums the slices, so both layouts need no other collective and
give the same output (up to the order of the sum). Routing follows transformers: softmax in
float32, top-k, optionally renormalised; the tokens of each expert are gathered and
run as one batch, and their weighted outputs added back in ascending expert order. ``forward`` hands
the chosen experts back on request (``RolloutConfig.return_routing``: the trainer replays them).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open

from rollpacker.hf_spec import ModelSpec


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
    """Where one HF tensor goes: local parameter (``index``: its entry along dim 0, an expert), row offset
    in it, the split dim (None: replicated) and, for an expert, its shard among ``of`` shards (the
    ranks that share it); ``local`` None: another rank's expert, not kept here."""
    local: str | None
    offset: int = 0
    split_dim: int | None = None
    index: int | None = None
    shard: int = 0
    of: int | None = None  # None: the TP rank among the TP size


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
    """One K+V pool of shape [layers, 2 * local KV heads, pages, page size, head dim].

    Rows ``[0, kv_heads)`` of dim 1 hold the keys, ``[kv_heads, 2 * kv_heads)`` the
    values. Head-major pages make the gathered keys and values of a decode step one
    contiguous [rows, 2 * heads, tokens, dim] tensor, the layout attention reads, from a
    single ``index_select`` (the fastest gather on CPU) per layer. The gather writes
    into a scratch buffer that is kept across steps and layers: a decode step at a large
    batch gathers tens of MB per layer, and a fresh allocation of that size is returned
    to the OS and page-faulted back in every time (thousands of faults per step).
    """

    def __init__(self, layers: int, pages: int, kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.kv = torch.zeros((layers, 2 * kv_heads, pages, page_size, head_dim), dtype=dtype, device=device)
        self.pages, self.page_size, self.kv_heads, self.head_dim = pages, page_size, kv_heads, head_dim
        self._scratch = torch.empty(0, page_size * head_dim, dtype=dtype, device=device)

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store tokens ``k``, ``v`` [N, heads, dim] at (``pages``, ``offsets``) [N]."""
        self.kv[layer][:, pages, offsets] = torch.cat((k, v), 1).transpose(0, 1)

    def lookup_index(self, block_table: torch.Tensor) -> torch.Tensor:
        """Rows of the [2 * heads * pages, page * dim] view that hold each row's pages: keys, then values."""
        heads = torch.arange(2 * self.kv_heads, device=block_table.device) * self.pages
        return (heads.view(1, -1, 1) + block_table.unsqueeze(1)).flatten()  # [B * 2 heads * pages per row]

    def read(self, layer: int, index: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [rows, heads, pages per row * page, dim] of the ``rows`` rows in ``index``.

        Views into the scratch buffer: valid until the next ``read``.
        """
        n = index.numel()
        if self._scratch.shape[0] < n:  # grow with headroom, so a growing batch reallocates rarely
            self._scratch = self._scratch.new_empty((n + n // 4, self._scratch.shape[1]))
        pool = self.kv[layer].view(2 * self.kv_heads * self.pages, -1)
        both = torch.index_select(pool, 0, index, out=self._scratch[:n]).view(rows, 2 * self.kv_heads, -1,
                                                                                 self.head_dim)
        return both[:, :self.kv_heads], both[:, self.kv_heads:]


class QwenTP:
    """One tensor-parallel shard of a Qwen2/Qwen3/Qwen3-MoE model (the whole model when ``tp_size == 1``)."""

    def __init__(self, spec: ModelSpec, *, tp_rank: int = 0, tp_size: int = 1, ep_size: int = 1,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if spec.num_heads % tp_size or spec.num_kv_heads % tp_size or spec.intermediate_size % tp_size:
            raise ValueError(f"TP size {tp_size} must divide the attention heads ({spec.num_heads}), KV heads "
                             f"({spec.num_kv_heads}) and intermediate size ({spec.intermediate_size})")
        if ep_size > 1 and (not spec.moe_layers or tp_size % ep_size or spec.num_experts % ep_size):
            raise ValueError(f"expert-parallel size {ep_size} needs a MoE model whose experts "
                             f"({spec.num_experts}) it divides, and must divide the TP size {tp_size}")
        expert_tp = tp_size // ep_size  # the ranks that share one expert
        if spec.moe_intermediate_size % expert_tp:
            raise ValueError(f"TP size {tp_size} / expert-parallel size {ep_size} must divide the experts' "
                             f"intermediate size ({spec.moe_intermediate_size})")
        self.spec, self.tp_rank, self.tp_size, self.group = spec, tp_rank, tp_size, group
        self.expert_shard, self.expert_tp = tp_rank % expert_tp, expert_tp
        local_experts = spec.num_experts // ep_size
        self.experts = range(tp_rank // expert_tp * local_experts, (tp_rank // expert_tp + 1) * local_experts)
        self.dtype, self.device = dtype, torch.device(device)
        self.heads = spec.num_heads // tp_size
        self.kv_heads = spec.num_kv_heads // tp_size
        self.ffn = spec.intermediate_size // tp_size
        self.moe_ffn = spec.moe_intermediate_size // expert_tp
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
                           p + "qkv_w": (q + 2 * kv, s.hidden_size), p + "o": (s.hidden_size, q)})
            if s.qkv_bias:
                shapes[p + "qkv_b"] = (q + 2 * kv,)
                targets.update({hf + "self_attn.q_proj.bias": _Target(p + "qkv_b", 0, 0),
                                hf + "self_attn.k_proj.bias": _Target(p + "qkv_b", q, 0),
                                hf + "self_attn.v_proj.bias": _Target(p + "qkv_b", q + kv, 0)})
            if s.qk_norm:
                shapes.update({p + "q_norm": (d,), p + "k_norm": (d,)})
                targets.update({hf + "self_attn.q_norm.weight": _Target(p + "q_norm"),
                                hf + "self_attn.k_norm.weight": _Target(p + "k_norm")})
            targets.update({
                hf + "input_layernorm.weight": _Target(p + "ln1"),
                hf + "post_attention_layernorm.weight": _Target(p + "ln2"),
                hf + "self_attn.q_proj.weight": _Target(p + "qkv_w", 0, 0),
                hf + "self_attn.k_proj.weight": _Target(p + "qkv_w", q, 0),
                hf + "self_attn.v_proj.weight": _Target(p + "qkv_w", q + kv, 0),
                hf + "self_attn.o_proj.weight": _Target(p + "o", 0, 1)})
            self._layout_mlp(i, shapes, targets)
        return shapes, targets

    def _layout_mlp(self, i: int, shapes: dict[str, tuple[int, ...]], targets: dict[str, _Target]) -> None:
        """Layer ``i``'s MLP: dense SwiGLU, or (a sparse layer) the router and the experts stacked on dim 0."""
        s, p, hf = self.spec, f"{i}.", f"model.layers.{i}.mlp."
        if i not in s.moe_layers:
            shapes.update({p + "gate_up": (2 * self.ffn, s.hidden_size), p + "down": (s.hidden_size, self.ffn)})
            targets.update({hf + "gate_proj.weight": _Target(p + "gate_up", 0, 0),
                            hf + "up_proj.weight": _Target(p + "gate_up", self.ffn, 0),
                            hf + "down_proj.weight": _Target(p + "down", 0, 1)})
            return
        n, f, mine = s.num_experts, self.moe_ffn, self.experts
        shapes.update({p + "router": (n, s.hidden_size), p + "experts_gate_up": (len(mine), 2 * f, s.hidden_size),
                       p + "experts_down": (len(mine), s.hidden_size, f)})
        targets[hf + "gate.weight"] = _Target(p + "router")
        shard = dict(shard=self.expert_shard, of=self.expert_tp)
        for e in range(n):
            ex = f"{hf}experts.{e}."
            if e not in mine:
                targets.update({ex + w: _Target(None) for w in ("gate_proj.weight", "up_proj.weight",
                                                                 "down_proj.weight")})
                continue
            k = e - mine.start
            targets.update({ex + "gate_proj.weight": _Target(p + "experts_gate_up", 0, 0, k, **shard),
                            ex + "up_proj.weight": _Target(p + "experts_gate_up", f, 0, k, **shard),
                            ex + "down_proj.weight": _Target(p + "experts_down", 0, 1, k, **shard)})

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

    def _slot(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(where this rank keeps its shard of the full HF tensor ``name``, that shard); None for
        another rank's expert."""
        target = self._targets.get(name)
        if target is None:
            raise KeyError(f"unknown {self.spec.model_type} weight name {name!r}")
        if target.local is None:
            return None
        if target.split_dim is not None:
            shard, of = (self.tp_rank, self.tp_size) if target.of is None else (target.shard, target.of)
            if tensor.shape[target.split_dim] % of:
                raise ValueError(f"{name}: dim {target.split_dim} of shape {tuple(tensor.shape)} "
                                 f"is not divisible into {of} shards")
            tensor = tensor.chunk(of, target.split_dim)[shard]
        dest = self.params[target.local]
        if target.index is not None:
            dest = dest[target.index]
        dest = dest.narrow(0, target.offset, tensor.shape[0])
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: got shape {tuple(tensor.shape)} for this rank's shard, "
                             f"expected {tuple(dest.shape)}")
        return dest, tensor

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's shard of the full HF tensor ``name`` into place."""
        if (slot := self._slot(name, tensor)) is not None:
            slot[0].copy_(slot[1])

    @torch.no_grad()
    def shard_diff(self, name: str, tensor: torch.Tensor) -> float:
        """max |stored shard - this rank's shard of the full tensor ``name``| (0 for another rank's expert)."""
        if (slot := self._slot(name, tensor)) is None or not slot[1].numel():
            return 0.0
        return float((slot[0].float() - slot[1].float()).abs().max())

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
        if x.dtype == torch.float32:  # one fused op, the same arithmetic as below
            return F.rms_norm(x, w.shape, w, self.spec.rms_norm_eps)
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
    def forward(self, plan: ForwardPlan, kv: PagedKV, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Run the layers, write KV, and return the final hidden state of each row's last token.

        ``routes``: a list to which each sparse layer, in ``spec.moe_layers`` order, appends the experts its
        router chose for every token, [B, T, top-k] (descending weight; padded tokens' rows are junk)."""
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
            keys_per_row = plan.block_table.shape[1] * kv.page_size
            # additive float mask, made once per step (SDPA would convert a bool mask in every layer)
            key_mask = torch.zeros(bsz, 1, 1, keys_per_row, dtype=self.dtype, device=self.device).masked_fill_(
                (torch.arange(keys_per_row, device=self.device) >= lengths.unsqueeze(1)).view(bsz, 1, 1, -1),
                float("-inf"))
        pages, offsets = plan.write_pages.to(self.device), plan.write_offsets.to(self.device)
        cos, sin = self._rope(positions)
        q_size, kv_size = self.heads * d, self.kv_heads * d
        x = p["embed"][ids]
        for i in range(s.num_layers):
            h = self._rms(x, p[f"{i}.ln1"])
            qkv = F.linear(h, p[f"{i}.qkv_w"], p.get(f"{i}.qkv_b"))
            qk = qkv[..., :q_size + kv_size].view(bsz, t, self.heads + self.kv_heads, d)
            if s.qk_norm:  # per head, before RoPE
                qk = torch.cat((self._rms(qk[:, :, :self.heads], p[f"{i}.q_norm"]),
                                self._rms(qk[:, :, self.heads:], p[f"{i}.k_norm"])), dim=2)
            qk = self._rotate(qk, cos, sin)
            q, k = qk[:, :, :self.heads], qk[:, :, self.heads:]
            v = qkv[..., q_size + kv_size:].view(bsz, t, self.kv_heads, d)
            if valid is not None:  # prefill: attend within the new tokens, store them
                kv.write(i, pages, offsets, k[valid], v[valid])
                attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True, enable_gqa=True)
            else:  # decode: store the one new token, attend over the row's pages
                kv.write(i, pages, offsets, k[:, 0], v[:, 0])
                keys, values = kv.read(i, index, bsz)
                attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=key_mask,
                                                      enable_gqa=True)
            x = x + self._reduce(F.linear(attn.transpose(1, 2).reshape(bsz, t, q_size), p[f"{i}.o"]))
            h = self._rms(x, p[f"{i}.ln2"])
            if i in s.moe_layers:
                x = x + self._reduce(self._moe(i, h.view(bsz * t, -1), routes).view(bsz, t, -1))
                if routes is not None:
                    routes[-1] = routes[-1].view(bsz, t, -1)
            else:
                gate, up = F.linear(h, p[f"{i}.gate_up"]).chunk(2, dim=-1)
                x = x + self._reduce(F.linear(F.silu(gate) * up, p[f"{i}.down"]))
        return x[torch.arange(bsz, device=self.device), lengths - 1] if valid is not None else x[:, 0]

    def _moe(self, i: int, h: torch.Tensor, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """This rank's part of sparse layer ``i``'s MLP on tokens ``h`` [N, hidden] (before the TP reduce);
        appends the chosen experts [N, top-k] to ``routes`` if given."""
        s, p = self.spec, self.params
        logits = F.linear(h, p[f"{i}.router"])
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), s.experts_per_token, dim=-1)
        if routes is not None:
            routes.append(experts)
        if s.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        # group the (token, choice) pairs by expert: one gather, one batched SwiGLU and one add per expert used
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        tokens, weights = order // s.experts_per_token, weights.flatten()[order]
        gate_up, down = p[f"{i}.experts_gate_up"], p[f"{i}.experts_down"]
        out = torch.zeros_like(h)
        counts = torch.bincount(flat, minlength=s.num_experts).tolist()  # one host sync
        start = sum(counts[:self.experts.start])
        for k, n in enumerate(counts[self.experts.start:self.experts.stop]):
            if n:
                rows = tokens[start:start + n]
                gate, up = F.linear(h[rows], gate_up[k]).chunk(2, dim=-1)
                out.index_add_(0, rows, F.linear(F.silu(gate) * up, down[k]) * weights[start:start + n, None])
                start += n
        return out

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.params["embed" if self.spec.tie_word_embeddings else "lm_head"]
        return F.linear(self._rms(hidden, self.params["norm"]), head).float()
