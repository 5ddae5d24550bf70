"""What one GPU's tensors weigh for a model and a layout: parameter counts, the Megatron trainer's
state, activations and log-prob buffers per pipeline stage, a rollout engine's weights and KV cache.
The memory plan (:mod:`rollpacker.plan`) adds them up per phase of a step.

Units: bytes; GB = 1e9 bytes.

Mixture-of-experts models (Qwen3-MoE) are sized with the trainer's expert
parallelism (``trainer.ep``): experts split over ep x tp, their optimizer state over
the expert-data-parallel ranks (:func:`trainer_state`), top-k routed activations
(:func:`moe_activation_bytes`), Megatron's sequence parallelism at tp > 1
(:func:`sequence_parallel`), and engines holding every expert over their TP.
Not modelled for them: routing imbalance (each EP rank's experts are assumed to
draw their share of a micro-batch's tokens), the token dispatcher's transient
buffers, and SGLang's fused-MoE workspaces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rollpacker.hf_spec import ModelSpec

GB = 10**9
BF16, FP32 = 2, 4
# megatron_ext/logprobs.py works on chunks of LOGPROB_CHUNK_TOKENS tokens (the same constant there;
# tests/unit/test_plan.py checks they agree). Its peak beside the bf16 logits: LOGIT_FP32_COPIES fp32
# [chunk, V/tp] tensors in the forward (log-probs, then the entropy); in the backward, the logits'
# gradient [tokens, V/tp] (their dtype) plus as many chunks (tests/unit/test_plan.py measures both).
LOGPROB_CHUNK_TOKENS = 2048
LOGIT_FP32_COPIES = 2
VOCAB_MULTIPLE = 128  # megatron_ext.model.padded_vocab_size: rows padded to 128 * tp


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f}"


# ---- model shapes -------------------------------------------------------------------------------

def padded_vocab(spec: ModelSpec, tp: int) -> int:
    multiple = VOCAB_MULTIPLE * tp
    return math.ceil(spec.vocab_size / multiple) * multiple


def hf_param_count(spec: ModelSpec) -> int:
    """Parameters of the HF checkpoint (the model card's figure)."""
    return sum(math.prod(shape) for shape in spec.hf_shapes().values())


def expert_param_count(spec: ModelSpec) -> int:
    """Parameters of the HF checkpoint's experts (0 for a dense model); the routers are not experts."""
    return len(spec.moe_layers) * spec.num_experts * 3 * spec.hidden_size * spec.moe_intermediate_size


def activated_params(spec: ModelSpec) -> int:
    """Parameters one token runs through (for FLOPs): every non-expert parameter and ``experts_per_token``
    of each sparse layer's ``num_experts`` experts (the model card's "activated"); all of a dense model."""
    experts = expert_param_count(spec)
    return hf_param_count(spec) - experts + (experts * spec.experts_per_token // spec.num_experts if experts else 0)


def _attention_weights(spec: ModelSpec, tp: int, kv_heads: int) -> int:
    """One decoder layer's attention and its two RMSNorms on one TP rank holding ``kv_heads`` KV heads;
    the norms are replicated."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d // tp, kv_heads * d
    bias = q + 2 * kv if spec.qkv_bias else 0
    qk_norm = 2 * d if spec.qk_norm else 0
    return h * (q + 2 * kv) + bias + q * h + 2 * h + qk_norm


def _mlp_weights(spec: ModelSpec, layer: int, tp: int, ep: int = 1) -> tuple[int, int]:
    """(non-expert, expert) MLP weights of layer ``layer`` on one GPU: a dense layer's SwiGLU split over
    TP; a sparse layer's router (replicated, a non-expert weight) and its ``num_experts / ep`` whole
    experts, each split over TP as a dense MLP is (Megatron's expert_tensor_parallel_size = tp)."""
    h = spec.hidden_size
    if layer not in spec.moe_layers:
        return 3 * h * spec.intermediate_size // tp, 0
    return spec.num_experts * h, spec.num_experts // ep * (3 * h * spec.moe_intermediate_size // tp)


def _stage_layers(spec: ModelSpec, pp: int, stage: int) -> range:
    per_stage = spec.num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def stage_param_split(spec: ModelSpec, tp: int, pp: int, stage: int, ep: int = 1) -> tuple[int, int]:
    """(non-expert, expert) parameters on one GPU of the Megatron trainer's pipeline stage ``stage``."""
    h, rows = spec.hidden_size, padded_vocab(spec, tp) // tp
    attention = _attention_weights(spec, tp, spec.num_kv_heads // tp)
    dense = expert = 0
    for layer in _stage_layers(spec, pp, stage):
        mlp, experts = _mlp_weights(spec, layer, tp, ep)
        dense, expert = dense + attention + mlp, expert + experts
    if stage == 0:
        dense += rows * h
    if stage == pp - 1:
        dense += h  # final norm
        if not spec.tie_word_embeddings or pp > 1:  # tied: the last stage keeps its own copy
            dense += rows * h
    return dense, expert


def stage_params(spec: ModelSpec, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Parameters on one GPU of the Megatron trainer's pipeline stage ``stage``."""
    return sum(stage_param_split(spec, tp, pp, stage, ep))


# ---- trainer ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainerState:
    """Bytes of the Megatron DDP buffers and the distributed optimizer's shard on one GPU."""

    params: int
    grads: int
    optimizer: int
    experts: int = 0  # of the three, the experts' share (params, grads and optimizer shard)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def trainer_state(spec: ModelSpec, *, tp: int, pp: int, stage: int, dp_cp: int, dtype: str,
                  ep: int = 1) -> TrainerState:
    """megatron-core 0.16.1 with ``grad_reduce_in_fp32=True`` and ``use_distributed_optimizer=True``
    (backend_gpu.py): params in their dtype, an fp32 gradient buffer for every local param, and the
    optimizer's shard over the DP x CP group (DDP reduces over ``dp_cp``): fp32 main params (bf16
    only; fp32 params are their own main copy) and Adam's two fp32 moments.

    Mixture of experts (``ep``: Megatron's expert_model_parallel_size, its expert_tensor_parallel_size
    = tp): a GPU holds ``num_experts / ep`` experts of each sparse layer, each split over TP, so the
    experts' params and grads are divided by ep * tp (and pp); their gradients are reduced and their
    optimizer state sharded over the expert-data-parallel group, the ranks holding the same experts:
    world / (ep * tp * pp) = dp_cp / ep. Everything else (attention, routers, embeddings) is sharded
    as in a dense model. Per GPU, expert optimizer bytes = 12 x expert params / world, whatever the layout.
    """
    if dp_cp % ep:
        raise ValueError(f"expert-parallel size {ep} does not divide the data-parallel x context-parallel "
                         f"size {dp_cp}")
    dense, expert = stage_param_split(spec, tp, pp, stage, ep)
    n, shard = dense + expert, math.ceil(dense / dp_cp) + math.ceil(expert / (dp_cp // ep))
    expert_shard = math.ceil(expert / (dp_cp // ep))
    if dtype == "bf16":
        return TrainerState(params=BF16 * n, grads=FP32 * n, optimizer=3 * FP32 * shard,
                            experts=(BF16 + FP32) * expert + 3 * FP32 * expert_shard)
    return TrainerState(params=FP32 * n, grads=FP32 * n, optimizer=2 * FP32 * shard,
                        experts=2 * FP32 * expert + 2 * FP32 * expert_shard)


def sequence_parallel(spec: ModelSpec, tp: int) -> bool:
    """Whether the trainer runs Megatron's sequence parallelism: for a mixture-of-experts model at
    tp > 1 (megatron_ext.model ``_moe_kwargs``: megatron-core trains MoE layers split over TP only
    so), never for a dense model. Each TP rank then keeps ``1/tp`` of the sequence's positions of
    what a layer holds outside its tensor-parallel regions (norms, residual stream, layer inputs)."""
    return spec.is_moe and tp > 1


def layer_activation_bytes(spec: ModelSpec, tp: int, tokens: int, *, te: bool = True, layer: int = 0,
                           alltoall: bool = True) -> int:
    """bf16 activations decoder layer ``layer`` keeps for backward, on one TP rank, for ``tokens`` tokens.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models" (arXiv:2205.05198), Sec. 4.1 counts per layer
    ``sbh(34 + 5as/h)`` bytes, ``sbh(10 + 24/t + 5as/(ht))`` with tensor
    parallelism and ``sbh(34/t + 5as/(ht))`` with sequence parallelism too.
    Their terms: attention 11sbh + 5as^2b (QKV input 2, Q and K 4, V 2,
    projection input 2, dropout mask 1; softmax output and its dropout mask
    5as^2b), MLP 19sbh (input 2, fc1 output 8, GeLU output 8, mask 1), the two
    LayerNorm inputs 4sbh. For Qwen2 on megatron-core 0.16.1 as configured here:

    - flash / fused attention keeps Q, K, V, its output and an fp32
      log-sum-exp per head, never the s x s scores: the 5as/h term drops;
    - dropout is 0 (no masks);
    - GQA: K and V are ``g*d`` wide, Q and the output ``a*d``;
    - RoPE makes new Q and K, while V stays a view of the fused QKV output,
      which attention's saved V keeps alive whole: 2(a+2g)d + 2(a+g)d;
    - SwiGLU through Megatron's unfused ``glu`` (``bias_activation_fusion``
      is off): the fc1 output ``[T, 2f/t]`` (alive through its chunks), then
      ``silu(gate)``, ``up + glu_linear_offset`` and their product (fc2's
      input), ``f/t`` each: 10f bytes where their GeLU MLP has 16h;
    - sequence parallelism is off for dense models, so the norm inputs and
      outputs (the QKV and fc1 inputs) are full ``h`` on every TP rank: 8h
      with Transformer Engine's fused norm + linear. Megatron's local layer
      (``te=False``) runs torch's RMSNorm, which keeps two fp32 copies of its
      input: 20h. With sequence parallelism (mixture-of-experts models at
      tp > 1, :func:`sequence_parallel`) each TP rank holds these for its
      ``T/tp`` positions only: the norms run on its sequence shard, and the
      linears after them gather the sequence in forward and save their
      un-gathered input (gathering again in backward): 8h/t (20h/t), which is
      Korthikanti's ``34/t``.

    - Qwen3's q/k norms read Q and K as views of the fused QKV output
      (already counted) and keep an fp32 1/rms per head, 4(a+g); torch's
      RMSNorm (``te=False``) keeps two fp32 copies of its input, 8(a+g)d more.
      This term is derived, not measured.

    bytes per token = 8h + (2(a+2g)d + 2(a+g)d + 2ad + 4a + 10f [+ qk norms]) / t,
    with sequence parallelism (8h + 2(a+2g)d + ...) / t.

    Measured on an H100 (torch 2.11, megatron-core 0.16.1, local layer,
    Qwen2.5-7B widths, 4 layers): one layer's saved tensors come to this
    formula with ``te=False`` plus RoPE's cos/sin tables (0.4%); a step's
    ``max_memory_allocated`` at 2048 and 4096 tokens came to 1.002x
    :func:`trainer_peak_bytes` (0.98-0.99x with recompute).

    Mixture of experts: a sparse layer (``layer in spec.moe_layers``) has no dense SwiGLU (no 10f)
    and adds :func:`moe_activation_bytes`. At tp > 1 the trainer runs MoE models under sequence
    parallelism (megatron-core trains an MoE layer split over TP only so), which splits the norms'
    8h (20h) over TP as above; a dense layer of an MoE model (``mlp_only_layers``) is split alike.
    """
    h, d, a, g, f = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    sparse = layer in spec.moe_layers
    sharded = 2 * (a + 2 * g) * d + 2 * (a + g) * d + 2 * a * d + 4 * a + (0 if sparse else 10 * f)
    if spec.qk_norm:
        sharded += 4 * (a + g) + (0 if te else 8 * (a + g) * d)
    positions = math.ceil(tokens / tp) if sequence_parallel(spec, tp) else tokens  # this rank's share of the norms
    return (positions * (8 if te else 20) * h + math.ceil(tokens * sharded / tp)
            + (moe_activation_bytes(spec, tp, tokens, alltoall=alltoall) if sparse else 0))


def moe_activation_bytes(spec: ModelSpec, tp: int, tokens: int, *, alltoall: bool = True) -> int:
    """What a sparse layer's router, token dispatcher and experts keep for backward on one GPU, for
    ``tokens`` tokens of its micro-batch (megatron-core 0.16.1 as megatron_ext.model configures it:
    fp32 router, aux-loss balancing, SequentialMLP experts, unfused permute and SwiGLU; the alltoall
    token dispatcher on a GPU, ``alltoall=False`` the allgather one megatron_ext uses on CPU). The
    norms and attention are :func:`layer_activation_bytes`'.

    At tp > 1 the layer runs under sequence parallelism (:func:`sequence_parallel`): a TP rank
    routes only its own ``T' = T/tp`` positions (``T' = T`` at tp 1), and the dispatcher gathers
    the rows its experts need over TP (token_dispatcher.py: the alltoall one all-gathers over the
    TP group after the EP all-to-all, the allgather one gathers over TP x EP), since each TP slice
    of an expert needs every row routed to that expert from the TP group's whole sequence.

    - router, on this rank's positions: the fp32 softmax over all experts the aux loss keeps, 4E;
      the routing's top-k indices over the logits (int64) and the fp32 softmax over the chosen
      ones, 12k (the aux loss's own top-k over its softmax saves indices too, but its node is
      dropped at once): ``T' (4E + 12k)``;
    - dispatcher: the fp32 probabilities ``[E, tokens]`` the ``masked_select`` that permutes them
      saves, its bool mask and the routing map the dispatcher keeps as an attribute, 6E per token
      it permutes. The alltoall dispatcher permutes this rank's positions before the exchange:
      ``T' (6E + 4E)`` with the router's ``[T', E]`` fp32 probabilities it keeps
      (``self.probs``), and the int64 position of each of its ``T' k`` routed rows, 8 each. The
      allgather one gathers the TP x EP group's routing and permutes ``T ep`` tokens for its
      ``E/ep`` experts: ``6E T`` whatever tp, and the int64 position of each of the ``T k`` rows its
      experts get. (It also gathers the group's hidden states into Megatron's global buffer,
      ``2h`` per token per EP rank, kept for the step and not counted here: it runs on CPU only.)
    - experts: each token reaches ``k`` experts, so with balanced routing a GPU's ``E/ep`` experts
      get ``T * ep * k / ep = T * k`` rows whatever ep and tp are: their full-width input ``2h``
      (not split over TP: each TP rank's slice of an expert needs every row), their fp32
      probability 4, and the SwiGLU over ``i/tp`` columns as in a dense layer, 10i, plus the
      probability-weighted copy fc2 reads, 2i: ``12i/tp``.

    bytes = T' (4E + 12k + 10E + 8k) + T k (2h + 4 + 12i/tp)   (alltoall)
          = T' (4E + 12k) + 6E T + T k (2h + 12 + 12i/tp)       (allgather);
    at tp 1 both are T (4E + 12k + 6E [+ 4E alltoall]) + T k (2h + 12 + 12i).
    Against a dense layer's ``10f/tp`` per token, top-k routing makes the MLP's share
    ``k * (2h + 12i/tp)``: sequence parallelism divides the router's and the alltoall dispatcher's
    per-token terms by tp, not the experts' rows. Checked against the tensors megatron-core's MoE layer keeps
    on CPU with the allgather dispatcher (tests/unit/test_plan.py, TP = EP = 1): equal but for 68
    bytes (the aux loss and the per-expert token counts); at TP = 2 under sequence parallelism (two
    CPU ranks, testkit's random Qwen3-MoE, 256 tokens; a one-off run, not in the test suite) the
    same 68 bytes. The alltoall terms are read from its code (that dispatcher needs CUDA). Routing is
    assumed balanced (the aux loss's aim): a GPU whose experts draw more than their share of a
    micro-batch keeps more. The dispatchers' transient copies (permuted, exchanged, gathered and
    sorted rows, ``2h`` per routed token each) live within one layer's forward or backward.
    """
    h, e, k, i = spec.hidden_size, spec.num_experts, spec.experts_per_token, spec.moe_intermediate_size
    local = math.ceil(tokens / tp) if sequence_parallel(spec, tp) else tokens  # positions this rank routes
    routed = tokens * k  # rows this GPU's experts get, gathered over TP
    router = local * (4 * e + 12 * k)
    if alltoall:
        dispatcher, rows = local * (6 * e + 4 * e + 8 * k), routed * (2 * h + 4)
    else:
        dispatcher, rows = tokens * 6 * e, routed * (2 * h + 12)
    return router + dispatcher + rows + math.ceil(routed * 12 * i / tp)


def activation_bytes(spec: ModelSpec, *, tp: int, pp: int, stage: int, tokens: int, recompute: bool,
                     te: bool = True) -> int:
    """Activations stage ``stage`` keeps at its peak, ``tokens`` per micro-batch on this GPU.

    1F1B: stage s runs pp - s forwards before its first backward, so the first stage holds as many
    layer-micro-batches as the whole model has layers (Korthikanti Sec. 4.2.3). Full recompute
    (Megatron's ``recompute_granularity="full"``, one layer per checkpoint) keeps each layer's
    input, ``2sbh`` bytes, and rebuilds one layer's working set at a time in backward; counting
    that layer on top of the log-prob buffers overstates the last stage by at most one layer, as
    backward rebuilds it after the logits are freed. A mixture-of-experts model's layers differ
    (sparse and dense); per GPU its activations do not depend on ``ep`` (:func:`moe_activation_bytes`).
    Under sequence parallelism (:func:`sequence_parallel`) the layer inputs a recompute keeps and
    the final norm's input and output are this TP rank's ``tokens/tp`` positions.
    """
    in_flight, layers = pp - stage, _stage_layers(spec, pp, stage)
    h = spec.hidden_size
    positions = math.ceil(tokens / tp) if sequence_parallel(spec, tp) else tokens
    per_layer = {sparse: layer_activation_bytes(spec, tp, tokens, te=te, layer=layer)
                 for layer in layers for sparse in (layer in spec.moe_layers,)}
    counts = {sparse: sum((layer in spec.moe_layers) == sparse for layer in layers) for sparse in per_layer}
    if recompute:
        kept = in_flight * len(layers) * BF16 * h * positions + max(per_layer.values())
    else:
        kept = in_flight * sum(per_layer[sparse] * counts[sparse] for sparse in per_layer)
    if stage == pp - 1:  # the final norm's input and output (the output layer's input), as in a layer
        kept += (4 if te else 10) * h * positions
    return kept


def logits_bytes(spec: ModelSpec, tp: int, tokens: int) -> int:
    """bf16 logits ``[tokens, V/tp]`` and the larger of the log-prob code's forward and backward peaks;
    under sequence parallelism too (the output layer gathers the sequence, then splits the vocabulary)."""
    cols, chunk = padded_vocab(spec, tp) // tp, min(tokens, LOGPROB_CHUNK_TOKENS)
    forward = LOGIT_FP32_COPIES * chunk * FP32
    backward = tokens * BF16 + LOGIT_FP32_COPIES * chunk * FP32
    return cols * (tokens * BF16 + max(forward, backward))


@dataclass(frozen=True)
class StagePeak:
    """What one GPU of pipeline stage ``stage`` holds at its training peak."""

    stage: int
    state: TrainerState
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.state.total + self.activations + self.logits


def stage_peak(spec: ModelSpec, *, tp: int, pp: int, stage: int, dp_cp: int, dtype: str, tokens: int,
               recompute: bool, te: bool = True, ep: int = 1) -> StagePeak:
    return StagePeak(stage, trainer_state(spec, tp=tp, pp=pp, stage=stage, dp_cp=dp_cp, dtype=dtype, ep=ep),
                     activation_bytes(spec, tp=tp, pp=pp, stage=stage, tokens=tokens, recompute=recompute, te=te),
                     logits_bytes(spec, tp, tokens) if stage == pp - 1 else 0)


def trainer_peak_bytes(spec: ModelSpec, tp: int, micro_batch_tokens: int, recompute: bool = False,
                       dtype: str = "bf16", *, pp: int = 1, cp: int = 1, dp: int = 1, te: bool = True,
                       ep: int = 1) -> int:
    """Predicted ``torch.cuda.max_memory_allocated()`` of one trainer rank (the worst PP stage).

    ``micro_batch_tokens``: tokens of the largest micro-batch, before the CP split; ``te``: whether
    Megatron runs Transformer Engine's layer (else its local one); ``ep``: expert parallelism (a
    mixture-of-experts model; ``dp * cp`` must be a multiple of it). Compare from the second
    optimizer step on (Adam's moments exist only after the first); the CUDA context is not part of it.
    """
    tokens = math.ceil(micro_batch_tokens / cp)
    return max(stage_peak(spec, tp=tp, pp=pp, stage=k, dp_cp=dp * cp, dtype=dtype, tokens=tokens,
                          recompute=recompute, te=te, ep=ep).total for k in range(pp))


# ---- rollout engines ----------------------------------------------------------------------------

def engine_weight_bytes(spec: ModelSpec, tp: int, dtype_bytes: int = BF16) -> int:
    """One GPU's shard of an engine's weights; SGLang replicates KV heads when TP exceeds them.

    Mixture of experts: the engine holds every expert of each sparse layer split over its TP
    group: ``num_experts * 3hi / tp`` per GPU, its router replicated. SGLang's own expert parallelism
    does not change that: ``ep_size`` divides the experts within the TP group, each expert then split
    over ``moe_tp_size = tp_size // ep_size // moe_dp_size`` (sglang 0.5.23,
    ``model_executor/model_runner_components/moe_ep_setup.py``; ``arg_groups/parallel_hook.py``
    asserts ``ep_size * moe_dp_size == tp_size`` with moe_dp_size > 1 and ep_size > 1, and the
    all-to-all backends reset ``ep_size`` to ``tp_size``, ``arg_groups/overrides.py``
    ``_a2a_ep_size``; that release's ``server_args.py`` only gathers these argument groups).
    rollpacker's SGLang backend leaves ``ep_size`` at 1.
    """
    h, rows = spec.hidden_size, math.ceil(spec.vocab_size / tp)
    attention = _attention_weights(spec, tp, max(1, spec.num_kv_heads // tp))
    n = sum(attention + sum(_mlp_weights(spec, layer, tp)) for layer in range(spec.num_layers)) + h + rows * h
    if not spec.tie_word_embeddings:
        n += rows * h
    return n * dtype_bytes


def kv_bytes_per_token(spec: ModelSpec, tp: int, dtype_bytes: int = BF16) -> int:
    """One GPU's KV cache for one token: K and V of every layer, for its share of the KV heads."""
    return 2 * spec.num_layers * max(1, spec.num_kv_heads // tp) * spec.head_dim * dtype_bytes
