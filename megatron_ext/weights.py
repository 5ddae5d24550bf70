"""Qwen2/Qwen3/Qwen3-MoE weights between HF safetensors and a TP-sharded, PP-staged, EP-split Megatron model.

Megatron fuses and shards tensors differently from HF:

* ``linear_qkv`` (weight and bias) is one column-parallel tensor laid out per
  query group, ``[q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]``;
  TP rank r holds groups ``[r*G, (r+1)*G)`` with ``G = num_kv_heads / tp``.
* ``linear_fc1`` is ``[gate; up]`` per rank: rank r holds
  ``[gate rows of r; up rows of r]``, so the full tensor is not ``[gate; up]``.
* ``linear_proj`` / ``linear_fc2`` are row-parallel (split along the input dim).
* Qwen3's per-head ``q_norm`` / ``k_norm`` are Megatron's ``q_layernorm`` /
  ``k_layernorm``: one ``head_dim`` vector shared by all heads, replicated.
* The embedding and output layer are vocab-parallel over the padded
  vocabulary; rows past the HF vocabulary are zero and dropped on export.
* With tied embeddings the output layer reuses the embedding; under PP the
  last stage holds its own copy, loaded from the HF embedding and never exported.
* A sparse (MoE) layer's router ``mlp.router`` is HF's ``mlp.gate``, replicated;
  its experts ``mlp.experts.local_experts.{j}`` are HF's ``mlp.experts.{e}``
  for the EP rank's global expert indices ``e``, each split over TP as a dense
  MLP is. An export gathers every expert from the EP rank that holds it.

Each model parameter is described once by a :class:`_Binding` (which HF
tensors it is cut from and how); loading and exporting both walk the bindings.
"""
from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_ext.parallel import ParallelLayout
from megatron_ext.model import QwenModel
from rollpacker.hf_spec import ModelSpec, load_hf_config, parse_spec

# Files copied next to an exported checkpoint when the source directory has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json", "chat_template.jinja")


class _Kind(Enum):
    REPLICATED = "replicated"  # norms (q/k norms too): every TP rank holds the whole tensor
    ROW = "row"  # split along dim 1
    VOCAB = "vocab"  # split along dim 0 over the padded vocabulary
    QKV = "qkv"  # fused q/k/v, grouped per KV head, split along dim 0
    FC1 = "fc1"  # fused gate/up, split along dim 0 per half


@dataclass(frozen=True)
class _Binding:
    param: torch.Tensor  # this rank's shard
    kind: _Kind
    hf_names: tuple[str, ...]
    export: bool = True  # False for the last stage's copy of tied embeddings
    expert: int | None = None  # a MoE expert's global index: held by one EP rank


def unwrap(model: torch.nn.Module) -> QwenModel:
    """The QwenModel inside DDP / Float16Module wrappers."""
    while not isinstance(model, QwenModel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, QwenModel):
        raise TypeError(f"expected a model from megatron_ext.model.build_model, got {type(model).__name__}")
    return model


def _param(module: torch.nn.Module, *names: str) -> torch.Tensor:
    # The local spec and the Transformer Engine spec name the pre-norms differently (TE fuses them).
    params = dict(module.named_parameters())
    for name in names:
        if name in params:
            return params[name]
    raise KeyError(f"{type(module).__name__} has none of the parameters {names}")


def _bindings(model: QwenModel) -> list[_Binding]:
    """This rank's parameters in export order: embedding, layers by number, final norm, output."""
    spec = model.hf_spec
    tied = spec.tie_word_embeddings
    out: list[_Binding] = []
    if model.pre_process:
        out.append(_Binding(model.embedding.word_embeddings.weight, _Kind.VOCAB, ("model.embed_tokens.weight",)))
    for layer in model.decoder.layers:
        p = f"model.layers.{layer.layer_number - 1}."  # Megatron numbers layers globally from 1
        attn = p + "self_attn."
        out += [
            _Binding(_param(layer, "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                     _Kind.REPLICATED, (p + "input_layernorm.weight",)),
            _Binding(_param(layer, "self_attention.linear_qkv.weight"), _Kind.QKV,
                     (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")),
        ]
        if spec.qkv_bias:
            out.append(_Binding(_param(layer, "self_attention.linear_qkv.bias"), _Kind.QKV,
                                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias")))
        if spec.qk_norm:
            out += [_Binding(_param(layer, "self_attention.q_layernorm.weight"), _Kind.REPLICATED,
                             (attn + "q_norm.weight",)),
                    _Binding(_param(layer, "self_attention.k_layernorm.weight"), _Kind.REPLICATED,
                             (attn + "k_norm.weight",))]
        out += [
            _Binding(_param(layer, "self_attention.linear_proj.weight"), _Kind.ROW, (attn + "o_proj.weight",)),
            _Binding(_param(layer, "pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
                     _Kind.REPLICATED, (p + "post_attention_layernorm.weight",)),
        ]
        if layer.layer_number - 1 in spec.moe_layers:
            out.append(_Binding(_param(layer, "mlp.router.weight"), _Kind.REPLICATED, (p + "mlp.gate.weight",)))
            for j, e in enumerate(layer.mlp.local_expert_indices):
                ours, theirs = f"mlp.experts.local_experts.{j}.", f"{p}mlp.experts.{e}."
                out += [_Binding(_param(layer, ours + "linear_fc1.weight"), _Kind.FC1,
                                 (theirs + "gate_proj.weight", theirs + "up_proj.weight"), expert=e),
                        _Binding(_param(layer, ours + "linear_fc2.weight"), _Kind.ROW, (theirs + "down_proj.weight",),
                                 expert=e)]
        else:
            out += [_Binding(_param(layer, "mlp.linear_fc1.weight"), _Kind.FC1,
                             (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                    _Binding(_param(layer, "mlp.linear_fc2.weight"), _Kind.ROW, (p + "mlp.down_proj.weight",))]
    if model.post_process:
        out.append(_Binding(model.decoder.final_layernorm.weight, _Kind.REPLICATED, ("model.norm.weight",)))
        if model.output_layer.weight is not None:  # None when tied and on the same stage as the embedding
            name = "model.embed_tokens.weight" if tied else "lm_head.weight"
            out.append(_Binding(model.output_layer.weight, _Kind.VOCAB, (name,), export=not tied))
    return out


def _shard(b: _Binding, src: list[Any], spec: ModelSpec, rank: int, tp: int) -> torch.Tensor:
    """Cut TP rank ``rank``'s shard of ``b`` from its HF tensors.

    ``src`` holds, per HF name, anything sliceable like a tensor (a safetensors
    slice reads only the rows/columns asked for).
    """
    rows = b.param.shape[0]
    if b.kind is _Kind.REPLICATED:
        return src[0][:]
    if b.kind is _Kind.ROW:
        cols = b.param.shape[1]
        return src[0][:, rank * cols:(rank + 1) * cols]
    if b.kind is _Kind.VOCAB:
        start, stop = rank * rows, min((rank + 1) * rows, spec.vocab_size)
        real = src[0][start:stop] if start < stop else torch.empty(0, b.param.shape[1])
        return torch.cat([real, real.new_zeros(rows - real.shape[0], b.param.shape[1])])
    if b.kind is _Kind.FC1:
        half = rows // 2
        return torch.cat([s[rank * half:(rank + 1) * half] for s in src])
    groups, hd = spec.num_kv_heads // tp, spec.head_dim  # QKV
    q_rows = groups * spec.heads_per_group * hd
    q = src[0][rank * q_rows:(rank + 1) * q_rows]
    k, v = (s[rank * groups * hd:(rank + 1) * groups * hd] for s in src[1:])
    rest = tuple(q.shape[1:])
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest)],
                     dim=1).reshape(-1, *rest)


def _unshard(b: _Binding, shards: list[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """The full HF tensors of ``b`` from all TP ranks' shards (the inverse of :func:`_shard`)."""
    if b.kind is _Kind.REPLICATED:
        return [shards[0].clone()]
    if b.kind is _Kind.ROW:
        return [torch.cat(shards, dim=1)]
    if b.kind is _Kind.VOCAB:
        return [torch.cat(shards)[:spec.vocab_size]]
    if b.kind is _Kind.FC1:
        halves = [s.chunk(2) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    full = torch.cat(shards)  # QKV
    rest = tuple(full.shape[1:])
    grouped = full.reshape(spec.num_kv_heads, spec.heads_per_group + 2, spec.head_dim, *rest)
    return [grouped[:, :spec.heads_per_group].reshape(-1, *rest),
            grouped[:, -2].reshape(-1, *rest).contiguous(), grouped[:, -1].reshape(-1, *rest).contiguous()]


class _SafetensorsDir:
    """Lazy tensor slices of an HF checkpoint directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: Path) -> None:
        self.dir = hf_dir
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            self.file_of = json.loads(index.read_text())["weight_map"]
        elif (hf_dir / "model.safetensors").is_file():
            with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
                self.file_of = {name: "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
        self._open: dict[str, Any] = {}

    def slice(self, name: str) -> Any:
        if name not in self.file_of:
            raise KeyError(f"{self.dir}: checkpoint has no tensor {name!r}")
        file = self.file_of[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.dir / file), "pt")
        return self._open[file].get_slice(name)


def load_hf_checkpoint(model: torch.nn.Module, hf_dir: str | Path) -> None:
    """Load this rank's TP shard / PP stage of the model from an HF safetensors directory.

    Reads only the tensors (and, for split tensors, only the slices) this rank
    holds. Needs no communication.
    """
    model = unwrap(model)
    hf_dir = Path(hf_dir)
    found = parse_spec(hf_dir)
    if found != model.hf_spec:
        raise ValueError(f"{hf_dir}/config.json describes {found}, but the model was built for {model.hf_spec}")
    tp_group = model.pg_collection.tp
    rank, tp = tp_group.rank(), tp_group.size()
    source = _SafetensorsDir(hf_dir)
    with torch.no_grad():
        for b in _bindings(model):
            shard = _shard(b, [source.slice(n) for n in b.hf_names], model.hf_spec, rank, tp)
            if shard.shape != b.param.shape:
                raise ValueError(f"{hf_dir}: {b.hf_names} gives a shard of shape {tuple(shard.shape)} "
                                 f"for a parameter of shape {tuple(b.param.shape)}")
            b.param.copy_(shard)


class HFLoader:
    """Loads a TP=1 model from full HF tensors arriving in any grouping (a weight sync's buckets).

    A parameter fused from several HF tensors (q/k/v, gate/up) is written once all of them have
    arrived; until then the ones seen are held here.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = unwrap(model)
        if self.model.pg_collection.tp.size() != 1:
            raise ValueError("HFLoader loads an unsharded (TP=1) model")
        self._bindings = _bindings(self.model)
        # at TP=1 and one stage each HF tensor feeds exactly one parameter (tied: the output layer has none)
        self._of_name = {n: b for b in self._bindings for n in b.hf_names}
        self._held: dict[str, torch.Tensor] = {}

    @property
    def names(self) -> set[str]:
        return set(self._of_name)

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Take these tensors; returns the HF names whose parameters are now fully written."""
        done: set[str] = set()
        for name, tensor in named_tensors:
            if name not in self._of_name:
                raise KeyError(f"unknown {self.model.hf_spec.model_type} weight name {name!r}")
            self._held[name] = tensor.detach().clone()  # a sync may reuse its bucket buffers
            b = self._of_name[name]
            if all(n in self._held for n in b.hf_names):
                shard = _shard(b, [self._held.pop(n) for n in b.hf_names], self.model.hf_spec, 0, 1)
                b.param.copy_(shard.to(b.param.dtype))
                done.update(b.hf_names)
        return done

    @torch.no_grad()
    def max_diff(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """The largest |model - given| over the given HF tensors."""
        full = {n: t for b in self._bindings if b.export
                for n, t in zip(b.hf_names, _unshard(b, [b.param.detach()], self.model.hf_spec))}
        worst = 0.0
        for name, tensor in named_tensors:
            worst = max(worst, (full[name].float() - tensor.float()).abs().max().item())
        return worst


def _gather_tp(b: _Binding, group: dist.ProcessGroup, spec: ModelSpec) -> list[torch.Tensor]:
    local = b.param.detach()
    if b.kind is _Kind.REPLICATED or group.size() == 1:
        shards = [local]
    else:
        shards = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(shards, local.contiguous(), group=group)
    return _unshard(b, shards, spec)


@torch.no_grad()
def iter_hf_tensors(model: torch.nn.Module, layout: ParallelLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for the whole model, one tensor at a time.

    Collective over the TP and PP groups: every rank of the layout must iterate
    to the end, and every rank yields every tensor, in the same order
    (embedding, layers in order, final norm, ``lm_head`` when untied). Tensors
    are gathered over TP on the stage that owns them, then broadcast over PP.
    They have the model's parameter dtype and device and never alias its
    parameters. Only one gathered tensor at a time is alive here.
    """
    model = unwrap(model)
    spec = model.hf_spec
    local = [b for b in _bindings(model) if b.export]
    if layout.pp == 1:
        yield from _stage_tensors(local, model, layout)
        return
    names_by_stage: list[list[str]] = [[] for _ in range(layout.pp)]
    dist.all_gather_object(names_by_stage, _stage_names(local, spec), group=layout.pp_group)
    shapes, dtype = spec.hf_shapes(), model.config.params_dtype
    for stage, names in enumerate(names_by_stage):
        src = dist.get_global_rank(layout.pp_group, stage)
        if stage == layout.pp_rank:
            for name, tensor in _stage_tensors(local, model, layout):
                tensor = tensor.contiguous()
                dist.broadcast(tensor, src, group=layout.pp_group)
                yield name, tensor
        else:
            for name in names:
                tensor = torch.empty(shapes[name], dtype=dtype, device=layout.device)
                dist.broadcast(tensor, src, group=layout.pp_group)
                yield name, tensor


def _expert_names(layer: int, expert: int) -> list[str]:
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return [p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"]


def _layer_of(b: _Binding) -> int:
    return int(b.hf_names[0].split(".")[2])


def _stage_names(local: list[_Binding], spec: ModelSpec) -> list[str]:
    """The HF names :func:`_stage_tensors` yields, in its order: a sparse layer's every expert."""
    names: list[str] = []
    for is_expert, group in itertools.groupby(local, key=lambda b: b.expert is not None):
        if not is_expert:
            names += [n for b in group for n in b.hf_names]
            continue
        layer = _layer_of(next(group))
        names += [n for e in range(spec.num_experts) for n in _expert_names(layer, e)]
    return names


def _stage_tensors(local: list[_Binding], model: QwenModel, layout: ParallelLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's full HF tensors on each of its ranks: gathered over TP; a sparse layer's
    experts, in expert order, each broadcast over EP from the rank that holds it."""
    spec = model.hf_spec
    for is_expert, group in itertools.groupby(local, key=lambda b: b.expert is not None):
        if not is_expert:
            for b in group:
                yield from zip(b.hf_names, _gather_tp(b, layout.tp_group, spec))
            continue
        mine = list(group)
        layer, per_rank = _layer_of(mine[0]), spec.num_experts // layout.ep
        held = {b.expert: [] for b in mine}
        for b in mine:
            held[b.expert].append(b)
        h, i = spec.hidden_size, spec.moe_intermediate_size
        for e in range(spec.num_experts):
            names = _expert_names(layer, e)
            if e in held:
                tensors = [t for b in held[e] for t in _gather_tp(b, layout.tp_group, spec)]
            else:  # another EP rank's: gate, up [i, h], down [h, i]
                tensors = [torch.empty(shape, dtype=model.config.params_dtype, device=layout.device)
                           for shape in ((i, h), (i, h), (h, i))]
            if layout.ep > 1:
                owner = dist.get_global_rank(layout.ep_group, e // per_rank)
                for t in tensors:
                    dist.broadcast(t, owner, group=layout.ep_group)
            yield from zip(names, tensors)


def save_hf_checkpoint(model: torch.nn.Module, layout: ParallelLayout, out_dir: str | Path,
                       hf_config: Mapping[str, Any] | str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` (and tokenizer files) to ``out_dir``.

    Collective (see :func:`iter_hf_tensors`); only ``layout.is_writer`` writes
    and holds the full model in memory. ``hf_config`` is the config to write (a
    dict, or a checkpoint directory whose tokenizer files are copied too).
    Returns once the files exist.
    """
    out_dir = Path(out_dir)
    tensors = {}
    for name, tensor in iter_hf_tensors(model, layout):
        if layout.is_writer:
            tensors[name] = tensor.cpu()
    try:
        if layout.is_writer:
            out_dir.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
            (out_dir / "config.json").write_text(json.dumps(load_hf_config(hf_config), indent=2) + "\n")
            if not isinstance(hf_config, Mapping):
                copy_tokenizer_files(hf_config, out_dir)
    finally:  # a writer that fails (a full disk) still releases the other ranks; its error is the caller's
        dist.barrier()


def copy_tokenizer_files(src_dir: str | Path, out_dir: str | Path) -> None:
    """Copy whichever of :data:`TOKENIZER_FILES` exist in ``src_dir`` to ``out_dir``."""
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copyfile(Path(src_dir) / name, Path(out_dir) / name)
