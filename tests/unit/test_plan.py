"""The memory plan (rollpacker/plan.py), its arithmetic (rollpacker/plan_sizes.py), its refusals, the shipped configs.

The command line, in a process of its own: tests/integration/test_plan_procs.py."""
from __future__ import annotations

import math
import weakref
from dataclasses import replace

import pytest
import torch

from rollpacker import plan, plan_sizes
from rollpacker.config import check_layout, load_config
from rollpacker.configlib import ConfigError
from rollpacker.hf_spec import parse_spec
from rollpacker.scheduler.config import PlannerConfig
from testkit import REPO_ROOT, make_random_qwen3_moe
from tests.dist.megatron_fixtures import layout  # noqa: F401  (pytest fixture)

CONFIGS = REPO_ROOT / "configs"
DEVICE = int(80e9)
PUBLISHED_WORLD = {"qwen2.5-7b": 16, "qwen2.5-14b": 32, "qwen2.5-32b": 64, "qwen3-8b": 8, "qwen3-30b-a3b": 8}

# make_random_qwen2's shape: h=64, 4 heads / 2 KV heads of d=16, ffn 160, 2 layers, vocab 250.
TINY = parse_spec(dict(model_type="qwen2", vocab_size=250, hidden_size=64, intermediate_size=160,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                       rope_theta=1e4, tie_word_embeddings=False))


@pytest.fixture
def no_cuda(monkeypatch):
    """check_memory plans against the device it sees; without one, against 80 GB."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _shipped(name: str, *overrides: str):
    return load_config(CONFIGS / f"{name}.yaml", list(overrides))


def _plan(name: str, *overrides: str) -> plan.MemoryPlan:
    cfg = _shipped(name, *overrides)
    return plan.plan_memory(cfg, plan.resolve_spec(cfg)[0], world_size=PUBLISHED_WORLD[name], device_bytes=DEVICE)


@pytest.mark.parametrize("name,total,non_embedding", [
    ("qwen2.5-7b", 7.61e9, 6.53e9),  # Qwen2.5-7B model card: 7.61B, 6.53B non-embedding
    ("qwen2.5-14b", 14.7e9, 13.1e9),  # Qwen2.5-14B: 14.7B, 13.1B
    ("qwen2.5-32b", 32.5e9, 31.0e9),  # Qwen2.5-32B: 32.5B, 31.0B
    ("qwen3-8b", 8.2e9, 6.95e9),  # Qwen3-8B: 8.2B, 6.95B
    ("qwen3-30b-a3b", 30.5e9, 29.9e9),  # Qwen3-30B-A3B: 30.5B, 29.9B
])
def test_shipped_shapes_have_the_published_parameter_counts(name, total, non_embedding):
    spec = parse_spec(plan.SHAPES_DIR / f"{name}.json")
    n = plan_sizes.hf_param_count(spec)
    embeddings = 2 * spec.vocab_size * spec.hidden_size  # untied input and output embeddings
    assert n == pytest.approx(total, rel=0.01)
    assert n - embeddings == pytest.approx(non_embedding, rel=0.01)
    # the trainer's shards add up to the model (vocab padding aside)
    shards = sum(plan_sizes.stage_params(spec, 2, 2, s) for s in range(2)) * 2
    assert shards == pytest.approx(n, rel=1e-3)


def test_tiny_model_by_hand():
    # one layer: q 64x64 + 64, k and v 2 x (32x64 + 32), o 64x64, gate/up/down 3 x 64x160, two norms 2 x 64
    layer = 64 * 64 + 64 + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 64 * 160 + 2 * 64
    assert layer == 43264
    # the trainer pads the vocab to 128 * tp = 256 rows; embedding + output layer + final norm
    params = 2 * layer + 2 * 256 * 64 + 64
    assert plan_sizes.stage_params(TINY, 1, 1, 0) == params == 119360
    assert plan_sizes.hf_param_count(TINY) == 2 * layer + 2 * 250 * 64 + 64
    state = plan_sizes.trainer_state(TINY, tp=1, pp=1, stage=0, dp_cp=2, dtype="bf16")
    assert (state.params, state.grads, state.optimizer) == (2 * params, 4 * params, 12 * params // 2)
    fp32 = plan_sizes.trainer_state(TINY, tp=1, pp=1, stage=0, dp_cp=2, dtype="fp32")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * params, 4 * params, 8 * params // 2)
    # per token: norm inputs and outputs 8h replicated; fused QKV output kept by V 2(a+2g)d, RoPE'd Q and
    # K 2(a+g)d, attention output 2ad, fp32 log-sum-exp 4a, SwiGLU 10f (all split over TP)
    sharded = 2 * (4 + 4) * 16 + 2 * (4 + 2) * 16 + 2 * 64 + 4 * 4 + 10 * 160
    assert plan_sizes.layer_activation_bytes(TINY, 1, 100) == 100 * (8 * 64 + sharded) == 270400
    assert plan_sizes.layer_activation_bytes(TINY, 2, 100) == 100 * (8 * 64 + sharded // 2)
    assert plan_sizes.layer_activation_bytes(TINY, 1, 100, te=False) == 270400 + 100 * 12 * 64  # torch RMSNorm's fp32
    final_norm = 4 * 64 * 100
    assert plan_sizes.activation_bytes(TINY, tp=1, pp=1, stage=0, tokens=100, recompute=False) == (
        2 * 270400 + final_norm)
    assert plan_sizes.activation_bytes(TINY, tp=1, pp=1, stage=0, tokens=100, recompute=True) == (
        2 * 2 * 64 * 100 + 270400 + final_norm)  # two layer inputs + one layer rebuilt
    # logits, then in backward their gradient and two fp32 chunks (100 tokens < one chunk)
    assert plan_sizes.logits_bytes(TINY, 1, 100) == 100 * 256 * (2 + 2 + 2 * 4)
    assert plan_sizes.trainer_peak_bytes(TINY, 1, 100) == state.params + state.grads + 12 * params + (
        2 * 270400 + final_norm + 100 * 256 * 12)
    # engines: bf16, vocab split without padding; K and V of 2 layers x 2 heads x 16 per token
    assert plan_sizes.engine_weight_bytes(TINY, 1) == 2 * plan_sizes.hf_param_count(TINY)
    assert plan_sizes.kv_bytes_per_token(TINY, 1) == 2 * 2 * 2 * 16 * 2
    assert plan_sizes.kv_bytes_per_token(TINY, 2) == 128
    assert plan_sizes.kv_bytes_per_token(TINY, 4) == 128  # 2 KV heads over 4 ranks: replicated, one per rank


def test_tiny_qwen3_by_hand():
    # make_random_qwen3's shape: 4 heads / 2 KV heads of d=32 (hidden 64). One layer: q 128x64, k and v
    # 2 x 64x64 (no bias), o 64x128, gate/up/down 3 x 64x160, two norms 2 x 64, q/k norms 2 x 32
    spec = parse_spec(dict(model_type="qwen3", vocab_size=250, hidden_size=64, intermediate_size=160,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False))
    layer = 128 * 64 + 2 * 64 * 64 + 64 * 128 + 3 * 64 * 160 + 2 * 64 + 2 * 32
    assert plan_sizes.stage_params(spec, 1, 1, 0) == 2 * layer + 2 * 256 * 64 + 64
    assert plan_sizes.hf_param_count(spec) == 2 * layer + 2 * 250 * 64 + 64
    # the q/k norms add an fp32 1/rms per head, 4(a+g); torch's RMSNorm two fp32 copies of Q and K, 8(a+g)d
    sharded = 2 * (4 + 4) * 32 + 2 * (4 + 2) * 32 + 2 * 128 + 4 * 4 + 10 * 160 + 4 * (4 + 2)
    assert plan_sizes.layer_activation_bytes(spec, 1, 100) == 100 * (8 * 64 + sharded)
    assert plan_sizes.layer_activation_bytes(spec, 1, 100, te=False) == 100 * (20 * 64 + sharded + 8 * 6 * 32)
    assert plan_sizes.kv_bytes_per_token(spec, 1) == 2 * 2 * 2 * 32 * 2


def test_pipeline_first_stage_holds_every_layer_in_flight():
    spec = parse_spec(plan.SHAPES_DIR / "qwen2.5-14b.json")
    one = plan_sizes.layer_activation_bytes(spec, 2, 1000)
    first = plan_sizes.activation_bytes(spec, tp=2, pp=2, stage=0, tokens=1000, recompute=False)
    last = plan_sizes.activation_bytes(spec, tp=2, pp=2, stage=1, tokens=1000, recompute=False)
    assert first == 48 * one and last == 24 * one + 4 * spec.hidden_size * 1000


def test_padding_rule_is_megatrons():
    from megatron_ext.model import padded_vocab_size
    spec = parse_spec(plan.SHAPES_DIR / "qwen2.5-7b.json")
    for tp in (1, 2, 4, 8):
        assert plan_sizes.padded_vocab(spec, tp) == padded_vocab_size(spec, tp)
        assert plan_sizes.padded_vocab(TINY, tp) == padded_vocab_size(TINY, tp)


def _fitting_tps(cfg, world: int) -> list[int]:
    """The rollout TPs whose engines fit: weights plus one longest request's KV in the static
    budget, and weights beside the trainer's params in the sync phase."""
    p = plan.plan_memory(cfg, plan.resolve_spec(cfg)[0], world_size=world, device_bytes=DEVICE)
    return [e.tp for e in p.engines if not e.problem]


@pytest.mark.parametrize("name", sorted(PUBLISHED_WORLD))
def test_shipped_configs_fit_eight_80gb_gpus_per_node(name, no_cuda):
    p = _plan(name)
    assert p.fits, p.render()
    assert all(p.left(phase) > 0 for phase in plan.PHASES)
    cfg = _shipped(name)
    world = PUBLISHED_WORLD[name]
    fitting = _fitting_tps(cfg, world)
    assert fitting == cfg.scheduler.planner.tp_choices(world, cfg.rollout.tp)
    assert cfg.rollout.tp in fitting
    plan.check_memory(cfg, world)  # sglang: checked even without CUDA, against 80 GB


def test_train_phase_that_cannot_fit_is_refused_with_the_fixes(no_cuda):
    no_recompute = "trainer.recompute=false"
    p = _plan("qwen2.5-7b", no_recompute)
    assert not p.fits and p.left("train") < 0
    (msg,) = p.problems
    assert msg.startswith("train phase needs 100.17 GB > 80.00 GB: activations 62.50 GB + log-prob buffers "
                          "6.23 GB + trainer state 28.56 GB; fix: trainer.recompute=true (activations 5.75 GB)")
    assert _plan("qwen2.5-7b").fits  # the fix, as shipped
    # the largest budget that fits is named, and it is exact
    assert "trainer.micro_batch_tokens <= 11486" in msg
    assert _plan("qwen2.5-7b", no_recompute, "trainer.micro_batch_tokens=11486").fits
    assert not _plan("qwen2.5-7b", no_recompute, "trainer.micro_batch_tokens=11487").fits
    # with longer responses no budget helps: the longest sequence always gets a micro-batch of its own
    (msg,) = _plan("qwen2.5-7b", no_recompute, "rollout.max_response_length=16384").problems
    assert "trainer.micro_batch_tokens <=" not in msg and "fix: trainer.recompute=true" in msg
    with pytest.raises(ConfigError, match=r"qwen2.5-7b.yaml: the memory plan does not fit 80.00 GB per GPU: "
                                          r"train phase .*trainer.recompute=true"):
        plan.check_memory(_shipped("qwen2.5-7b", no_recompute), 16)


def test_longest_sequence_sets_the_micro_batch():
    # 1024 + 32768 tokens over CP 4: the packer gives that sequence a micro-batch of its own
    assert "8448 tokens per micro-batch per GPU" in _plan("qwen2.5-32b").header[3]
    p = _plan("qwen2.5-32b", "trainer.recompute=false", "trainer.micro_batch_tokens=40000")
    assert "10000 tokens per micro-batch per GPU" in p.header[3]
    # a smaller budget cannot help, and the plan says so
    assert any("micro_batch_tokens alone does not suffice" in m for m in p.problems)


def test_engines_that_cannot_fit_are_named_with_the_smallest_tp_that_does(no_cuda):
    # C6: every rank would build a TP-1 Qwen2.5-32B engine (65.5 GB); a TP-2 one (32.8 GB) fits beside the
    # trainer's 16.4 GB of params in the sync phase
    cfg = _shipped("qwen2.5-32b", "scheduler.planner.min_tp=1")
    p = plan.plan_memory(cfg, plan.resolve_spec(cfg)[0], world_size=64, device_bytes=DEVICE)
    (tp1,) = p.problems
    assert tp1.startswith("rollout engine TP 1: weights 65.53 GB") and "mem_fraction_static" in tp1
    assert "scheduler.planner.min_tp=2" in tp1
    assert _fitting_tps(cfg, 64) == [2, 4, 8]
    with pytest.raises(ConfigError, match="rollout engine TP 1"):
        plan.check_memory(cfg, 64)
    # the trainer's params alone can crowd an engine out of the sync phase: unsplit, Qwen2.5-32B's are 65.5 GB
    p = _plan("qwen2.5-32b", "trainer.tp=1")
    tp4, tp8 = (m for m in p.problems if "in the sync phase" in m)
    assert tp4.startswith("rollout engine TP 4 in the sync phase: trainer params 65.53 GB + engine weights 16.38 GB "
                          "+ weight push 4.67 GB + CUDA contexts 2.16 GB = 88.74 GB > 80.00 GB")
    assert tp8.endswith("fewer resident trainer params (a higher trainer.tp), or a shorter rollout.max_response_length")


def test_preflight_refuses_before_any_work(tmp_path, monkeypatch, capsys, no_cuda):
    from rollpacker.runtime.preflight import preflight
    model = tmp_path / "Qwen2.5-7b"
    model.mkdir()
    (model / "config.json").write_text((plan.SHAPES_DIR / "qwen2.5-7b.json").read_text())
    (tmp_path / "train.jsonl").write_text("")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        preflight(["--config", str(CONFIGS / "qwen2.5-7b.yaml"), f"model.path={model}",
                   f"data.train_files=[{tmp_path / 'train.jsonl'}]", "data.eval_files=[]", "trainer.recompute=false",
                   f"run.output_dir={tmp_path}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "memory plan does not fit" in err and "trainer.recompute=true" in err


def test_min_tp_limits_the_engines_built():
    assert PlannerConfig(min_tp=4, max_tp=8).tp_choices(64, 4) == [4, 8]
    assert PlannerConfig(min_tp=4, max_tp=8, enabled=False).tp_choices(64, 2) == [2]
    with pytest.raises(ConfigError, match="min_tp=16 must be <= max_tp=8"):
        PlannerConfig(min_tp=16).validate()


def test_cpu_config_is_not_planned(no_cuda):
    plan.check_memory(_shipped("tiny-cpu", "model.path=/nonexistent"), 2)  # reference backend, no CUDA


@pytest.mark.parametrize("tokens", [512, 1024])
def test_log_prob_memory_matches_logprobs_py(layout, monkeypatch, tokens):
    """The plan's log-prob term against torch's profiler: the loss's forward (log-probs and, from the
    same pass, the entropy) and backward, one chunk (512 tokens) and four (1024 tokens in chunks of 256)."""
    from types import SimpleNamespace

    from torch.profiler import ProfilerActivity, profile

    from megatron_ext import logprobs
    assert logprobs.CHUNK_TOKENS == plan_sizes.LOGPROB_CHUNK_TOKENS
    monkeypatch.setattr(logprobs, "CHUNK_TOKENS", 256)
    monkeypatch.setattr(plan_sizes, "LOGPROB_CHUNK_TOKENS", 256)
    vocab = 1024
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab - 24, (tokens,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logp, _ = logprobs.token_logprobs(logits, labels, layout.tp_group, vocab_size=vocab - 24, with_entropy=True)
        logp.sum().backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    spec = SimpleNamespace(vocab_size=vocab)  # padded_vocab reads only this
    planned = plan_sizes.logits_bytes(spec, 1, tokens) - tokens * vocab * plan_sizes.BF16  # the logits existed before
    print(f"log-prob peak {peak} bytes, planned {planned}")
    assert peak == pytest.approx(planned, rel=0.02)


def test_recompute_reaches_megatron_and_keeps_the_gradients(layout, tmp_path):
    from megatron_ext.model import build_model
    from megatron_ext.weights import load_hf_checkpoint
    from testkit import make_random_qwen2
    model_dir = make_random_qwen2(tmp_path / "m")
    ids = torch.randint(0, 250, (2, 32))
    pos = torch.arange(32).expand(2, 32)
    grads, saved = [], []
    for recompute in (False, True):
        model = build_model(model_dir, recompute=recompute, pg_collection=layout.pg_collection)
        load_hf_checkpoint(model, model_dir)
        assert model.config.recompute_granularity == ("full" if recompute else None)
        storages = {}

        def keep(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(ids, pos, attention_mask=None).float().square().mean()
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
        saved.append(sum(storages.values()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert saved[1] < saved[0] / 2


# ---- mixture of experts -------------------------------------------------------------------------

MOE = parse_spec(plan.SHAPES_DIR / "qwen3-30b-a3b.json")
# testkit's random Qwen3-MoE: Qwen3's attention (4 heads / 2 KV heads of d=32, hidden 64), 8 experts of
# width 32, top 2, layers 0 and 2 sparse, layer 1 dense (ffn 160), vocab 250.
TINY_MOE = parse_spec(dict(model_type="qwen3_moe", vocab_size=250, hidden_size=64, intermediate_size=160,
                           moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                           norm_topk_prob=True, mlp_only_layers=[1], rms_norm_eps=1e-6, rope_theta=1e4,
                           tie_word_embeddings=False))


def test_activated_params_are_the_model_cards():
    # Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated; 48 layers x 128 experts x 3 x 2048 x 768
    assert plan_sizes.expert_param_count(MOE) == 48 * 128 * 3 * 2048 * 768
    assert plan_sizes.activated_params(MOE) == pytest.approx(3.3e9, rel=0.02)
    print(f"Qwen3-30B-A3B: {plan_sizes.hf_param_count(MOE) / 1e9:.2f}e9 params, "
          f"{plan_sizes.activated_params(MOE) / 1e9:.2f}e9 activated")
    dense = parse_spec(plan.SHAPES_DIR / "qwen3-8b.json")
    assert plan_sizes.expert_param_count(dense) == 0
    assert plan_sizes.activated_params(dense) == plan_sizes.hf_param_count(dense)


def test_tiny_moe_by_hand():
    attention = 128 * 64 + 2 * 64 * 64 + 64 * 128 + 2 * 64 + 2 * 32  # q, k, v, o, two norms, q/k norms
    router, expert, dense_mlp = 8 * 64, 3 * 64 * 32, 3 * 64 * 160
    layers = 3 * attention + 2 * router + dense_mlp + 2 * 8 * expert
    assert plan_sizes.hf_param_count(TINY_MOE) == layers + 2 * 250 * 64 + 64
    # the trainer: experts split over ep by whole experts (and over tp); the routers replicated
    assert plan_sizes.stage_param_split(TINY_MOE, 1, 1, 0) == (
        3 * attention + 2 * router + dense_mlp + 2 * 256 * 64 + 64, 2 * 8 * expert)
    assert plan_sizes.stage_param_split(TINY_MOE, 1, 1, 0, ep=4)[1] == 2 * 2 * expert
    assert (plan_sizes.stage_param_split(TINY_MOE, 1, 1, 0, ep=4)[0]
            == plan_sizes.stage_param_split(TINY_MOE, 1, 1, 0)[0])
    assert plan_sizes.stage_param_split(TINY_MOE, 2, 1, 0, ep=4)[1] == 2 * 2 * expert // 2
    # the engine holds every expert; at TP 1 that is the checkpoint
    assert plan_sizes.engine_weight_bytes(TINY_MOE, 1) == 2 * plan_sizes.hf_param_count(TINY_MOE)
    # a sparse layer: no dense SwiGLU; per token the router's 4E + 12k and the dispatcher's 6E (+ 4E: the
    # alltoall one keeps the router's probabilities), per routed token (k = 2 per token) its hidden state 2h,
    # index + probability 12 and the expert's SwiGLU 12i
    t, e, k, i, h = 100, 8, 2, 32, 64
    dense = plan_sizes.layer_activation_bytes(TINY_MOE, 1, t, layer=1)
    assert dense == plan_sizes.layer_activation_bytes(parse_spec(dict(
        model_type="qwen3", vocab_size=250, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4)), 1, t)
    allgather = t * (4 * e + 12 * k) + t * 6 * e + t * k * (2 * h + 12 + 12 * i)
    assert plan_sizes.moe_activation_bytes(TINY_MOE, 1, t, alltoall=False) == allgather
    assert plan_sizes.moe_activation_bytes(TINY_MOE, 1, t) == allgather + t * 4 * e
    assert plan_sizes.layer_activation_bytes(TINY_MOE, 1, t, layer=0) == dense - t * 10 * 160 + allgather + t * 4 * e
    # at TP 2 (sequence parallel): the router and the alltoall dispatcher's maps and indices cover this rank's
    # t/2 positions; the experts' rows, gathered over TP, stay t * k and whole (each TP slice of an expert needs
    # them), their SwiGLU splits
    local = t // 2
    assert plan_sizes.moe_activation_bytes(TINY_MOE, 2, t) == (
        local * (4 * e + 12 * k + 10 * e + 8 * k) + t * k * (2 * h + 4 + 12 * i // 2))
    # the allgather dispatcher gathers the TP x EP group's routing: its 6E per token and the rows' indices stay
    assert plan_sizes.moe_activation_bytes(TINY_MOE, 2, t, alltoall=False) == (
        local * (4 * e + 12 * k) + t * 6 * e + t * k * (2 * h + 12 + 12 * i // 2))


def test_experts_halve_when_ep_doubles_and_dense_models_are_unchanged():
    """Per GPU, doubling ep halves the experts' params and grads; their optimizer shard, 12 bytes per
    expert parameter over the world, stays; so do the activations (each GPU's experts get T * k rows)."""
    world = 16
    states = {ep: plan_sizes.trainer_state(MOE, tp=1, pp=1, stage=0, dp_cp=world, dtype="bf16", ep=ep)
              for ep in (1, 2, 4, 8, 16)}
    expert_total = plan_sizes.expert_param_count(MOE)
    for ep, state in states.items():
        dense, expert = plan_sizes.stage_param_split(MOE, 1, 1, 0, ep)
        assert expert == expert_total // ep
        assert state.experts == 6 * expert + 12 * math.ceil(expert / (world // ep))
        assert 12 * math.ceil(expert / (world // ep)) == pytest.approx(12 * expert_total / world)
        print(f"ep {ep}: experts {plan_sizes.gb(state.experts)} GB of trainer state {plan_sizes.gb(state.total)} GB")
    for ep in (1, 2, 4, 8):
        params_grads = lambda s: s.params + s.grads  # noqa: E731
        assert params_grads(states[ep]) - params_grads(states[2 * ep]) == 6 * expert_total // (2 * ep)
        assert states[ep].experts - states[2 * ep].experts == 6 * expert_total // (2 * ep)
    assert len({plan_sizes.stage_peak(MOE, tp=1, pp=1, stage=0, dp_cp=world, dtype="bf16", tokens=8192, recompute=False,
                                ep=ep).activations for ep in states}) == 1
    # a dense model: ep is 1, and the plans are those printed in docs/gpu.md
    for name, totals in (("qwen2.5-7b", ["58.88", "29.00", "43.41"]), ("qwen2.5-14b", ["59.60", "45.20", "38.62"]),
                         ("qwen2.5-32b", ["58.16", "39.60", "66.08"])):
        assert [plan_sizes.gb(_plan(name).total(phase)) for phase in plan.PHASES] == totals, name
    assert not any(line.startswith("experts:") for line in _plan("qwen2.5-7b").header)


def test_sequence_parallel_splits_moe_activations_over_tp_and_leaves_dense_models_alone():
    """A mixture-of-experts model at tp > 1 trains under sequence parallelism (megatron_ext.model): what a
    layer keeps outside its tensor-parallel regions (norms, layer inputs, the final norm) and the router's
    and alltoall dispatcher's per-token terms are this rank's T/tp positions; the experts' T*k gathered rows
    (2h + 4 each) are not split, their SwiGLU is (12i/tp). A dense model at tp > 1 keeps its plan."""
    h, e, k, i = MOE.hidden_size, MOE.num_experts, MOE.experts_per_token, MOE.moe_intermediate_size
    t = 17408
    assert plan_sizes.sequence_parallel(MOE, 2) and not plan_sizes.sequence_parallel(MOE, 1)
    rows = t * k * (2 * h + 4)  # the experts' rows: the same at every tp
    per_position = lambda tp: (plan_sizes.moe_activation_bytes(MOE, tp, t)  # noqa: E731
                               - rows - t * k * 12 * i // tp)
    assert per_position(1) == t * (4 * e + 12 * k + 10 * e + 8 * k)
    for tp in (2, 4):
        assert per_position(tp) * tp == per_position(1)
        # the whole layer: every term but the experts' rows divided by tp
        one, split = (plan_sizes.layer_activation_bytes(MOE, n, t, layer=0) for n in (1, tp))
        assert split - rows == pytest.approx((one - rows) / tp, abs=4)
        # with recompute: the layer inputs kept and the final norm's, too; at fixed ep (activations do not
        # depend on it) and fixed pp
        for recompute in (False, True):
            acts = {n: plan_sizes.activation_bytes(MOE, tp=n, pp=1, stage=0, tokens=t, recompute=recompute)
                    for n in (1, tp)}
            layers = MOE.num_layers if not recompute else 1
            assert acts[tp] - layers * rows == pytest.approx((acts[1] - layers * rows) / tp, abs=4 * MOE.num_layers)
        # the log-prob buffers are [T, V/tp], as for a dense model at that tp
        assert plan_sizes.logits_bytes(MOE, tp, t) < plan_sizes.logits_bytes(MOE, 1, t) / tp * 1.01
    # the plan's activations at tp 2 vs tp 1, ep 4 either way (16 GPUs)
    cfg = _shipped("qwen3-30b-a3b", "trainer.ep=4")
    plans = {tp: plan.plan_memory(replace(cfg, trainer=replace(cfg.trainer, tp=tp)), MOE, world_size=16,
                                  device_bytes=DEVICE, fixes=False) for tp in (1, 2)}
    acts = {tp: next(item.nbytes for item in p.items if item.name.startswith("activations") and item.counted)
            for tp, p in plans.items()}
    assert acts[2] == plan_sizes.activation_bytes(MOE, tp=2, pp=1, stage=0, tokens=t, recompute=True) < acts[1] / 1.8
    # dense models: no sequence parallelism, the norms whole on every TP rank (8h per token with TE)
    dense = parse_spec(plan.SHAPES_DIR / "qwen2.5-7b.json")
    assert not plan_sizes.sequence_parallel(dense, 2)
    one, two = (plan_sizes.layer_activation_bytes(dense, n, 1000) for n in (1, 2))
    assert one - 1000 * 8 * dense.hidden_size == 2 * (two - 1000 * 8 * dense.hidden_size)


def test_moe_layer_activations_match_megatron(layout, tmp_path):
    """The plan's sparse layer against what megatron-core 0.16.1's MoE layer keeps for backward on CPU
    (TP = EP = 1, every expert local, the allgather dispatcher megatron_ext uses there): the model the
    trainer builds, bf16, Megatron's local layers."""
    from megatron_ext.model import build_model
    ckpt = make_random_qwen3_moe(tmp_path / "moe")
    spec = parse_spec(ckpt)
    assert spec.moe_layers == (0, 2)
    model = build_model(ckpt, params_dtype=torch.bfloat16, pg_collection=layout.pg_collection)
    tokens = 256
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    running, saved = [None], {i: [] for i in range(spec.num_layers)}
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: running.__setitem__(0, i))
        layer.register_forward_hook(lambda module, args, out: running.__setitem__(0, None))

    def keep(t):
        if running[0] is not None:
            saved[running[0]].append(weakref.ref(t))
        return t
    ids, pos = torch.randint(0, 250, (1, tokens)), torch.arange(tokens).expand(1, tokens)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = model(ids, pos, attention_mask=None)
    measured = {}  # what is still kept with the output alive (a node dropped at once frees its tensors)
    for i, layer in enumerate(model.decoder.layers):
        alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in (ref() for ref in saved[i]) if t is not None}
        local_map = getattr(getattr(layer.mlp, "token_dispatcher", None), "local_map", None)  # kept as an attribute
        if local_map is not None:
            alive[local_map.untyped_storage().data_ptr()] = local_map.untyped_storage().nbytes()
        measured[i] = sum(n for ptr, n in alive.items() if ptr not in params)
    del out
    planned = {i: plan_sizes.layer_activation_bytes(spec, 1, tokens, te=False, layer=i, alltoall=False)
               for i in range(spec.num_layers)}
    for i in range(spec.num_layers):
        print(f"layer {i} ({'sparse' if i in spec.moe_layers else 'dense'}): measured {measured[i]} bytes, "
              f"planned {planned[i]} ({measured[i] / planned[i]:.4f}x)")
    # both kinds of layer keep what the plan leaves out alike (RoPE's cos/sin tables, the norms' fp32
    # 1/rms: large beside a 64-wide model); the sparse layers' MoE part is the plan's to within a few
    # bytes (the aux loss's scalar and the per-expert token counts)
    for i in spec.moe_layers:
        assert abs((measured[i] - planned[i]) - (measured[1] - planned[1])) <= 128
        assert measured[i] == pytest.approx(planned[i], rel=0.06)


def test_expert_parallel_sizes_are_checked_naming_trainer_ep():
    cfg = _shipped("qwen3-30b-a3b")  # tp 4, ep 2 on 8 GPUs
    plan.check_expert_parallel(cfg, MOE, 8)
    tp1 = ("trainer.tp=1", "trainer.ep=8")
    plan.check_expert_parallel(_shipped("qwen3-30b-a3b", *tp1), MOE, 16)
    with pytest.raises(ConfigError, match=r"qwen3-30b-a3b.yaml: trainer.ep=8 does not divide world size / "
                                          r"\(trainer.tp\*trainer.pp\) = 8/\(1\*2\) = 4.*choose trainer.ep "
                                          r"among \[1, 2, 4\]"):
        plan.check_expert_parallel(_shipped("qwen3-30b-a3b", *tp1, "trainer.pp=2"), MOE, 8)
    with pytest.raises(ConfigError, match=r"trainer.ep=8 does not divide .* choose trainer.ep dividing 4"):
        plan.check_expert_parallel(_shipped("qwen3-30b-a3b", *tp1, "trainer.pp=2"), None, 8)  # model not read yet
    with pytest.raises(ConfigError, match=r"trainer.ep=3 does not divide the model's num_experts=128 .*"
                                          r"among \[1, 2, 4\]"):
        plan.check_expert_parallel(_shipped("qwen3-30b-a3b", "trainer.tp=1", "trainer.pp=2", "trainer.ep=3"), MOE, 24)
    with pytest.raises(ConfigError, match=r"trainer.ep=2 needs a mixture-of-experts model.*set trainer.ep=1"):
        plan.check_expert_parallel(_shipped("qwen3-8b", "trainer.ep=2"), parse_spec(plan.SHAPES_DIR / "qwen3-8b.json"),
                                   8)
    with pytest.raises(ConfigError, match="trainer.ep=2 does not divide"):  # the plan itself refuses it too
        plan.plan_memory(_shipped("qwen3-30b-a3b"), MOE, world_size=4, device_bytes=DEVICE)


def test_moe_layout_that_cannot_fit_is_refused_with_the_keys_and_a_layout_that_does(no_cuda):
    """Qwen3-30B-A3B without tensor or expert parallelism (tp = ep = 1) on 8 x 80 GB: 229 GB of trainer state per
    GPU in the train phase, and its 61.1 GB of params crowd every engine out of the sync phase."""
    p = _plan("qwen3-30b-a3b", "trainer.tp=1", "trainer.ep=1", "trainer.stream=true")
    assert not p.fits
    print("\n".join(p.problems))
    train = next(m for m in p.problems if m.startswith("train phase"))
    assert train.startswith("train phase needs 250.44 GB > 80.00 GB: activations 6.22 GB + log-prob buffers 13.07 GB "
                            "+ trainer state 228.99 GB; fix: trainer.ep=8 with trainer.stream=false (trainer state "
                            "76.79 GB, not enough alone)")
    assert train.endswith("or the layout trainer.tp=4 trainer.pp=1 trainer.ep=2 with trainer.stream=false, which fits")
    sync = [m for m in p.problems if "in the sync phase" in m]
    assert len(sync) == 2 and all("trainer params 61.06 GB" in m and "a higher trainer.tp, trainer.ep or trainer.pp"
                                  in m for m in sync)
    with pytest.raises(ConfigError, match=r"qwen3-30b-a3b.yaml: the memory plan does not fit 80.00 GB per GPU: .*"
                                          r"train phase needs .*trainer.ep=8.*trainer.tp=4 trainer.pp=1 trainer.ep=2"):
        plan.check_memory(_shipped("qwen3-30b-a3b", "trainer.tp=1", "trainer.ep=1"), 8)
    # where no layout can fit, the plan says why: four GPUs cannot hold 18 bytes per parameter of 30.5e9 in the
    # train phase; on 32 GPUs of 20 GB that floor (17.2 GB) would fit, but not the sync phase's: the params'
    # 2 bytes per parameter beside the lightest engine's weights, the weight push and the CUDA contexts
    (four,) = [m for m in _plan_on("qwen3-30b-a3b", 4, "trainer.tp=1", "trainer.ep=4").problems
               if m.startswith("train phase")]
    assert four.endswith("are 137.39 GB per GPU over 4 GPUs at best: more GPUs")
    small = _shipped("qwen3-30b-a3b", "rollout.mem_fraction_static=0.9", "rollout.tp=4", "scheduler.planner.min_tp=4",
                     "scheduler.planner.short_tp=4")
    (small_train,) = [m for m in plan.plan_memory(small, MOE, world_size=32, device_bytes=int(20e9)).problems
                      if m.startswith("train phase")]
    assert small_train.endswith(
        "no trainer.tp/pp/ep layout fits with the rest as it is, nor can one: in the sync phase the trainer params "
        "(bf16 weights, 2 bytes per parameter, are 1.91 GB per GPU over 32 GPUs at best) sit beside the engine weights "
        "(TP 4, the lightest built: 15.29 GB), the weight push (1.87 GB) and the CUDA contexts (1.44 GB): 20.50 GB > "
        "20.00 GB: more GPUs")


def _plan_on(name: str, world: int, *overrides: str) -> plan.MemoryPlan:
    cfg = _shipped(name, *overrides)
    return plan.plan_memory(cfg, plan.resolve_spec(cfg)[0], world_size=world, device_bytes=DEVICE)


def _totals(p: plan.MemoryPlan) -> list[str]:
    return [plan_sizes.gb(p.total(phase)) for phase in plan.PHASES]


@pytest.mark.parametrize("name", sorted(PUBLISHED_WORLD))
def test_sync_phase_holds_the_trainer_params_alone(name):
    """The phase machine offloads the optimizer's state and frees the grads on TRAIN -> SYNC (the params stay for
    the weight push; SYNC -> ROLLOUT offloads them): in the sync phase a GPU holds the trainer's params, the awake
    engine set's weights, the weight push buffers and the CUDA contexts, never the optimizer shard."""
    from types import SimpleNamespace

    from rollpacker.memory_phases import Phase, PhaseMachine
    calls = []
    trainer = SimpleNamespace(**{m: (lambda m=m: calls.append(m)) for m in ("offload_optimizer", "offload", "onload")})
    machine = PhaseMachine(trainer, lambda: [], SimpleNamespace(record=lambda *args: None))
    machine.to(Phase.SYNC)
    assert calls == ["offload_optimizer"]
    machine.to(Phase.ROLLOUT)
    assert calls == ["offload_optimizer", "offload"]

    p = _plan(name)
    item = {prefix: next(i for i in p.items if i.name.startswith(prefix))
            for prefix in ("trainer params", "trainer grads", "optimizer shard", "engine weights", "weight push",
                           "CUDA contexts")}
    assert item["trainer params"].where == (plan.HOST, plan.GPU, plan.GPU)
    assert item["trainer grads"].where == (plan.FREED, plan.FREED, plan.GPU)
    assert item["optimizer shard"].where == (plan.HOST, plan.HOST, plan.GPU)
    assert p.total("sync") == sum(item[k].nbytes for k in ("trainer params", "engine weights", "weight push",
                                                           "CUDA contexts"))
    # every engine set beside the same params: the largest of any pipeline stage's
    cfg, spec = _shipped(name), plan.resolve_spec(_shipped(name))[0]
    t = cfg.trainer
    dp_cp = PUBLISHED_WORLD[name] // (t.tp * t.pp * t.cp) * t.cp
    params = max(plan_sizes.trainer_state(spec, tp=t.tp, pp=t.pp, stage=k, dp_cp=dp_cp, dtype=t.params_dtype,
                                          ep=t.ep).params for k in range(t.pp))
    assert params == item["trainer params"].nbytes
    for e in p.engines:
        assert e.sync_total == params + e.weights + item["weight push"].nbytes + item["CUDA contexts"].nbytes
    assert p.engines[0].sync_total == p.total("sync")
    # the grads and the optimizer shard are the train phase's alone, beside its activations and log-prob buffers
    train_only = sum(i.nbytes for i in p.items if i.counted and i.where == (plan.ABSENT, plan.ABSENT, plan.GPU))
    assert p.total("train") - p.total("sync") == (item["trainer grads"].nbytes + item["optimizer shard"].nbytes
                                                  + train_only - item["engine weights"].nbytes
                                                  - item["weight push"].nbytes)


def test_qwen3_30b_a3b_fits_one_node(no_cuda, tmp_path):
    """With the trainer's params alone in the sync phase, the train phase decides the layout on one node of
    8 x 80 GB: tp 4 (its log-prob buffers and, under sequence parallelism, activations a quarter of tp 1's)."""
    p = _plan("qwen3-30b-a3b")
    print(p.render())
    assert p.fits
    cfg = _shipped("qwen3-30b-a3b")
    model = tmp_path / "Qwen3-30b-a3b"  # the layout checks that read the model: heads, experts, sparse layers
    model.mkdir()
    (model / "config.json").write_text((plan.SHAPES_DIR / "qwen3-30b-a3b.json").read_text())
    check_layout(_shipped("qwen3-30b-a3b", f"model.path={model}"), 8, require_files=False)
    assert (cfg.trainer.tp, cfg.trainer.pp, cfg.trainer.ep, cfg.trainer.stream, cfg.rollout.tp) == (4, 1, 2, False, 2)
    planner = cfg.scheduler.planner
    assert (planner.short_tp, planner.long_tp, planner.min_tp, planner.max_tp) == (2, 4, 2, 4)
    assert _totals(p) == ["58.16", "42.61", "77.38"]
    assert [e.tp for e in p.engines] == [2, 4]
    assert p.header[-1].endswith("trainer ep 2: 64 experts per GPU, each split over tp 4, expert data parallel 1, "
                                 "65.23 GB of the trainer state; sequence parallel over tp")
    # the alternative the config names, with a pipeline, is accepted and fits too
    check_layout(_shipped("qwen3-30b-a3b", f"model.path={model}", "trainer.pp=2", "trainer.ep=1"), 8,
                 require_files=False)
    assert _totals(_plan("qwen3-30b-a3b", "trainer.pp=2", "trainer.ep=1")) == ["58.16", "42.21", "75.77"]
    # the least split layout that fits one node, the config's; tp 1 and 2 fit the sync phase but not train
    # (docs/gpu.md, the config's comment); TP-4 engines alone leave 0.72 GB more in every phase
    assert plan.fitting_layouts(cfg, MOE, world_size=8, device_bytes=DEVICE) == [(4, 1, 2, None), (4, 2, 1, None)]
    closest = {layout: _totals(_plan("qwen3-30b-a3b", *(f"trainer.{key}={n}" for key, n in
                                                        zip(("tp", "pp", "ep"), layout))))
               for layout in ((1, 1, 8), (2, 1, 4))}
    assert closest == {(1, 1, 8): ["58.16", "44.90", "98.24"], (2, 1, 4): ["58.16", "43.37", "84.32"]}
    assert _totals(_plan("qwen3-30b-a3b", "rollout.tp=4", "scheduler.planner.min_tp=4",
                         "scheduler.planner.short_tp=4")) == ["57.44", "26.63", "76.66"]
    assert plan.PUBLISHED_NODES["qwen3-30b-a3b"] == 1
