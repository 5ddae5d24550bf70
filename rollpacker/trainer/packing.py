"""Samples -> micro-batches: balancing across data-parallel ranks, packing by a token budget.

Everything here is deterministic (ties broken by input order), so every rank
of a replica computes the same split from the same list without talking.

Two layouts carry identical numerics, differing only in where padding sits:

* ``thd`` (GPU): all sequences of a micro-batch concatenated into one row
  ``[1, T]``, with ``cu_seqlens`` for the varlen attention kernels; the
  backend wraps them into Megatron's ``PackedSeqParams``;
* ``padded`` (CPU, where no varlen kernel exists): one right-padded row per
  sequence ``[B, S]``; causal attention never lets a real token see the
  padding, and the padding is masked out of the loss.

Token ``i`` of a row is trained to predict token ``i+1``, so the loss mask
covers the positions whose *next* token is a response token.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from rollpacker.sample import Sample
from rollpacker.trainer.grpo import Aggregation, token_weights

Layout = Literal["padded", "thd"]


def sequence_length(sample: Sample) -> int:
    """Tokens a sample occupies in a micro-batch (its compute cost)."""
    return len(sample.prompt.input_ids) + len(sample.response_ids)


def balance(lengths: Sequence[int], num_bins: int, start: Sequence[int] | None = None) -> list[list[int]]:
    """Split item indices over ``num_bins`` bins with near-equal total length.

    Longest-processing-time greedy: items by decreasing length go to the
    lightest bin (lowest index on ties), counting ``start`` as each bin's load
    before any item. Each bin lists its indices in input order. The heaviest
    bin exceeds the mean load by less than the longest item.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    heap = [(int(start[b]) if start is not None else 0, b) for b in range(num_bins)]
    heapq.heapify(heap)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return [sorted(b) for b in bins]


# What one more micro-batch costs on the padded (CPU) layout, in padded tokens: a forward and
# backward of the example policy costs ~15 ms before its first token and ~0.1 ms per token.
MICRO_BATCH_OVERHEAD_TOKENS = 150


def pack(lengths: Sequence[int], budget: int, layout: Layout = "thd") -> list[list[int]]:
    """Group item indices into micro-batches that each cost at most ``budget`` tokens.

    A micro-batch costs what its layout computes on: the sum of its lengths
    (``thd``, packed first-fit decreasing), or rows x its longest row
    (``padded``, see ``_pack_padded``). An item longer than the budget gets a
    micro-batch of its own: the budget bounds packing, it never drops or
    truncates a sequence.
    """
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if layout == "padded":
        return _pack_padded(lengths, order, budget)
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                batches[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            batches.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in batches]


def _pack_padded(lengths: Sequence[int], order: list[int], budget: int) -> list[list[int]]:
    """Cut the items, longest first, into consecutive runs of least total padded cost.

    Filling by real tokens would put one long response among short ones and
    pad every short row up to it (2-3x the work on long-tailed batches).
    Dynamic programme over the sorted items: ``best[j]`` is the cheapest
    split of the ``j`` longest, a run's cost is rows x its first (widest) row
    plus the per-micro-batch overhead.
    """
    width = [lengths[i] for i in order]
    best = [0] + [None] * len(order)
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j - 1, -1, -1):
            rows = j - i
            if rows > 1 and rows * width[i] > budget:  # earlier starts are wider and longer still
                break
            cost = best[i] + rows * width[i] + MICRO_BATCH_OVERHEAD_TOKENS
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    batches, j = [], len(order)
    while j:
        batches.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return batches[::-1]


TOKEN_FIELDS = ("input_ids", "position_ids", "labels", "loss_mask", "advantages", "weights", "rollout_logprobs",
                "sequence_starts", "sequence_index", "ref_logprobs")


@dataclass
class MicroBatch:
    """One forward/backward's worth of sequences, all per-token tensors of one shape."""

    input_ids: torch.Tensor  # long
    position_ids: torch.Tensor  # long
    labels: torch.Tensor  # long, next token (0 where masked)
    loss_mask: torch.Tensor  # float, 1 where the next token is a response token
    advantages: torch.Tensor  # float64, the sequence's advantage on every position
    weights: torch.Tensor  # float64, aggregation weight per position
    rollout_logprobs: torch.Tensor  # float64, engine log-prob of the next token (NaN if none)
    sequence_starts: torch.Tensor  # float, 1 on the first loss position of each sequence
    sequence_index: torch.Tensor  # long, the position's sequence (0..num_sequences-1; padding: any)
    real: torch.Tensor  # bool, a token of a sequence (False: padding; MoE routing leaves it out)
    layout: Layout
    cu_seqlens: torch.Tensor | None  # int32 [n+1] (thd only), offsets of padded sequences
    cu_seqlens_unpadded: torch.Tensor | None  # int32 [n+1] (thd only), true lengths
    max_seqlen: int
    num_tokens: int  # real (unpadded) tokens, the compute cost
    num_sequences: int
    ref_logprobs: torch.Tensor | None = None  # filled by the trainer when kl_coef > 0
    # routing replay: the engine's experts per position [*input_ids.shape, sparse layers, k] (long);
    # positions it never fed (a sequence's last token, padding) name experts 0..k-1, whose outputs
    # no trained position reads
    routing: torch.Tensor | None = None

    def to(self, device: torch.device | str, *, seqlens_device: torch.device | str | None = None) -> "MicroBatch":
        """Every tensor on ``device``, except ``cu_seqlens*`` on ``seqlens_device`` (default: ``device``)."""
        def where(name: str) -> torch.device | str:
            return seqlens_device if seqlens_device is not None and name.startswith("cu_seqlens") else device
        moved = {k: (v.to(where(k)) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return MicroBatch(**moved)


def _sequence_rows(sample: Sample, weight: float, index: int) -> dict[str, list]:
    prompt, response = list(sample.prompt.input_ids), list(sample.response_ids)
    tokens = prompt + response
    n, p, r = len(tokens), len(prompt), len(response)
    rollout = list(sample.rollout_logprobs) if sample.rollout_logprobs else [float("nan")] * r
    if len(rollout) != r:
        raise ValueError(f"sample {sample.request_id}: {len(rollout)} rollout log-probs for {r} response tokens")
    # position i predicts token i+1; response tokens start at index p
    return {
        "input_ids": tokens,
        "position_ids": list(range(n)),
        "labels": tokens[1:] + [0],
        "loss_mask": [0.0] * (p - 1) + [1.0] * r + [0.0],
        "advantages": [float(sample.advantage)] * n,
        "weights": [weight] * n,
        "rollout_logprobs": [float("nan")] * (p - 1) + rollout + [float("nan")],
        "sequence_starts": [0.0] * (p - 1) + [1.0] + [0.0] * r,
        "sequence_index": [index] * n,
        "real": [True] * n,
    }


_DTYPES = {"input_ids": torch.long, "position_ids": torch.long, "labels": torch.long, "loss_mask": torch.float32,
           "advantages": torch.float64, "weights": torch.float64, "rollout_logprobs": torch.float64,
           "sequence_starts": torch.float32, "sequence_index": torch.long, "real": torch.bool}
_PAD = {"rollout_logprobs": float("nan")}


def check_trainable(sample: Sample) -> None:
    """Refuse a sample the loss cannot use, naming it and the missing field."""
    if sample.advantage is None:
        raise ValueError(f"sample {sample.request_id} has no advantage; compute group advantages first")
    if not sample.prompt.input_ids:
        raise ValueError(f"sample {sample.request_id} has an empty prompt")
    if not sample.response_ids:
        raise ValueError(f"sample {sample.request_id} has no response tokens")


def _routing(samples: Sequence[Sample], starts: Sequence[tuple[int, int]], shape: tuple[int, int],
             experts: tuple[int, int]) -> torch.Tensor:
    """``MicroBatch.routing`` of ``samples`` placed at (row, column) ``starts`` in a ``shape`` grid;
    ``experts``: (sparse layers, k)."""
    layers, k = experts
    out = torch.arange(k).expand(*shape, layers, k).clone()
    for s, (row, col) in zip(samples, starts):
        fed = len(s.prompt.input_ids) + len(s.response_ids) - 1
        if len(s.routed_experts) != fed * layers * k:
            raise ValueError(f"sample {s.request_id}: {len(s.routed_experts)} routed experts for {fed} fed tokens x "
                             f"{layers} sparse layers x top-{k}; the engine must report routing (rollout.return_routing)")
        out[row, col:col + fed] = torch.tensor(s.routed_experts, dtype=torch.long).view(fed, layers, k)
    return out


def build_micro_batch(samples: Sequence[Sample], *, aggregation: Aggregation, layout: Layout,
                      pad_multiple: int = 1, row_width: int | None = None,
                      experts: tuple[int, int] | None = None) -> MicroBatch:
    """Lay out ``samples`` as one micro-batch. ``pad_multiple`` (thd) rounds each sequence up,
    as context/sequence parallelism require; ``row_width`` (padded) fixes the rows' width.
    ``experts``: (sparse layers, top-k) of a model whose routing is replayed."""
    if not samples:
        raise ValueError("a micro-batch needs at least one sample")
    for s in samples:
        check_trainable(s)
    weights = token_weights([len(s.response_ids) for s in samples], aggregation)
    rows = [_sequence_rows(s, w, i) for i, (s, w) in enumerate(zip(samples, weights))]
    lengths = [len(r["input_ids"]) for r in rows]
    if layout == "padded":
        width = max(lengths) if row_width is None else row_width
        if width < max(lengths):
            raise ValueError(f"a sequence of {max(lengths)} tokens does not fit rows of {row_width}")
        cols = {k: torch.tensor([r[k] + [_PAD.get(k, 0)] * (width - len(r[k])) for r in rows], dtype=dt)
                for k, dt in _DTYPES.items()}
        routing = None if experts is None else _routing(samples, [(i, 0) for i in range(len(rows))],
                                                        (len(rows), width), experts)
        return MicroBatch(**cols, layout=layout, cu_seqlens=None, cu_seqlens_unpadded=None,
                          max_seqlen=width, num_tokens=sum(lengths), num_sequences=len(rows), routing=routing)
    if layout != "thd":
        raise ValueError(f"micro-batch layout must be 'padded' or 'thd', got {layout!r}")
    padded = [-(-n // pad_multiple) * pad_multiple for n in lengths]
    cols = {}
    for k, dt in _DTYPES.items():
        flat: list = []
        for r, width in zip(rows, padded):
            pad = list(range(len(r[k]), width)) if k == "position_ids" else [_PAD.get(k, 0)] * (width - len(r[k]))
            flat += r[k] + pad
        cols[k] = torch.tensor([flat], dtype=dt)
    offsets = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    true_offsets = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    routing = None if experts is None else _routing(samples, [(0, int(o)) for o in offsets[:-1]],
                                                    (1, int(offsets[-1])), experts)
    return MicroBatch(**cols, layout=layout, cu_seqlens=offsets, cu_seqlens_unpadded=true_offsets,
                      max_seqlen=max(padded), num_tokens=sum(lengths), num_sequences=len(rows), routing=routing)


def filler_micro_batch(layout: Layout, *, rows: int = 1, width: int = 1) -> MicroBatch:
    """A micro-batch of padding alone (nothing trained, counted or measured): ``rows`` rows of ``width``
    (padded), or one sequence of ``width`` tokens (thd)."""
    shape = (rows, width) if layout == "padded" else (1, width)
    cols = {k: torch.full(shape, _PAD.get(k, 0), dtype=dt) for k, dt in _DTYPES.items()}
    cols["position_ids"] = torch.arange(width).expand(*shape).clone()
    seqlens = None if layout == "padded" else torch.tensor([0, width], dtype=torch.int32)
    return MicroBatch(**cols, layout=layout, cu_seqlens=seqlens, cu_seqlens_unpadded=seqlens,
                      max_seqlen=width, num_tokens=0, num_sequences=1)


def pad_micro_batch(mb: MicroBatch, rows: int, width: int) -> MicroBatch:
    """A padded-layout ``mb`` widened to ``rows`` x ``width`` with padding (nothing of it trained)."""
    if mb.layout != "padded":
        raise ValueError("only padded-layout micro-batches are padded to a shape")
    r, w = mb.input_ids.shape
    if (r, w) == (rows, width):
        return mb
    out = filler_micro_batch("padded", rows=rows, width=width)
    for k in _DTYPES:
        getattr(out, k)[:r, :w] = getattr(mb, k)
    if mb.ref_logprobs is not None:
        raise ValueError("pad a micro-batch before its reference log-probs are attached")
    routing = None
    if mb.routing is not None:
        layers, k = mb.routing.shape[2:]
        routing = torch.arange(k).expand(rows, width, layers, k).clone()
        routing[:r, :w] = mb.routing
    return MicroBatch(**{k: getattr(out, k) for k in _DTYPES}, layout="padded", cu_seqlens=None,
                      cu_seqlens_unpadded=None, max_seqlen=width, num_tokens=mb.num_tokens,
                      num_sequences=mb.num_sequences, routing=routing)


def plan_micro_batches(samples: Sequence[Sample], *, budget: int, aggregation: Aggregation, layout: Layout,
                       pad_multiple: int = 1, row_width: int | None = None,
                       experts: tuple[int, int] | None = None) -> list[MicroBatch]:
    """Pack ``samples`` into micro-batches that each cost at most ``budget`` tokens in ``layout``
    (rows of ``row_width`` cost that much each); ``experts``: see ``build_micro_batch``."""
    lengths = [sequence_length(s) if row_width is None else row_width for s in samples]
    groups = pack(lengths, budget, layout)
    return [build_micro_batch([samples[i] for i in g], aggregation=aggregation, layout=layout,
                              pad_multiple=pad_multiple, row_width=row_width, experts=experts) for g in groups]
