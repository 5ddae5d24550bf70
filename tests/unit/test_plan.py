"""The memory plan (rollpacker/plan.py): its arithmetic, its refusals, the shipped configs.

The command line, in a process of its own: tests/integration/test_plan_procs.py."""
from __future__ import annotations

import pytest
import torch

from rollpacker import plan
from rollpacker.config import load_config
from rollpacker.configlib import ConfigError
from rollpacker.hf_spec import parse_spec
from rollpacker.scheduler.config import PlannerConfig
from testkit import REPO_ROOT
from tests.dist.megatron_fixtures import layout  # noqa: F401  (pytest fixture)

CONFIGS = REPO_ROOT / "configs"
DEVICE = int(80e9)
PUBLISHED_WORLD = {"qwen2.5-7b": 16, "qwen2.5-14b": 32, "qwen2.5-32b": 64, "qwen3-8b": 8}

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
])
def test_shipped_shapes_have_the_published_parameter_counts(name, total, non_embedding):
    spec = parse_spec(plan.SHAPES_DIR / f"{name}.json")
    n = plan.hf_param_count(spec)
    embeddings = 2 * spec.vocab_size * spec.hidden_size  # untied input and output embeddings
    assert n == pytest.approx(total, rel=0.01)
    assert n - embeddings == pytest.approx(non_embedding, rel=0.01)
    # the trainer's shards add up to the model (vocab padding aside)
    shards = sum(plan.stage_params(spec, 2, 2, s) for s in range(2)) * 2
    assert shards == pytest.approx(n, rel=1e-3)


def test_tiny_model_by_hand():
    # one layer: q 64x64 + 64, k and v 2 x (32x64 + 32), o 64x64, gate/up/down 3 x 64x160, two norms 2 x 64
    layer = 64 * 64 + 64 + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 64 * 160 + 2 * 64
    assert layer == 43264
    # the trainer pads the vocab to 128 * tp = 256 rows; embedding + output layer + final norm
    params = 2 * layer + 2 * 256 * 64 + 64
    assert plan.stage_params(TINY, 1, 1, 0) == params == 119360
    assert plan.hf_param_count(TINY) == 2 * layer + 2 * 250 * 64 + 64
    state = plan.trainer_state(TINY, tp=1, pp=1, stage=0, dp_cp=2, dtype="bf16")
    assert (state.params, state.grads, state.optimizer) == (2 * params, 4 * params, 12 * params // 2)
    fp32 = plan.trainer_state(TINY, tp=1, pp=1, stage=0, dp_cp=2, dtype="fp32")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * params, 4 * params, 8 * params // 2)
    # per token: norm inputs and outputs 8h replicated; fused QKV output kept by V 2(a+2g)d, RoPE'd Q and
    # K 2(a+g)d, attention output 2ad, fp32 log-sum-exp 4a, SwiGLU 10f (all split over TP)
    sharded = 2 * (4 + 4) * 16 + 2 * (4 + 2) * 16 + 2 * 64 + 4 * 4 + 10 * 160
    assert plan.layer_activation_bytes(TINY, 1, 100) == 100 * (8 * 64 + sharded) == 270400
    assert plan.layer_activation_bytes(TINY, 2, 100) == 100 * (8 * 64 + sharded // 2)
    assert plan.layer_activation_bytes(TINY, 1, 100, te=False) == 270400 + 100 * 12 * 64  # torch RMSNorm's fp32
    final_norm = 4 * 64 * 100
    assert plan.activation_bytes(TINY, tp=1, pp=1, stage=0, tokens=100, recompute=False) == 2 * 270400 + final_norm
    assert plan.activation_bytes(TINY, tp=1, pp=1, stage=0, tokens=100, recompute=True) == (
        2 * 2 * 64 * 100 + 270400 + final_norm)  # two layer inputs + one layer rebuilt
    # logits, then in backward their gradient and two fp32 chunks (100 tokens < one chunk)
    assert plan.logits_bytes(TINY, 1, 100) == 100 * 256 * (2 + 2 + 2 * 4)
    assert plan.trainer_peak_bytes(TINY, 1, 100) == state.params + state.grads + 12 * params + (
        2 * 270400 + final_norm + 100 * 256 * 12)
    # engines: bf16, vocab split without padding; K and V of 2 layers x 2 heads x 16 per token
    assert plan.engine_weight_bytes(TINY, 1) == 2 * plan.hf_param_count(TINY)
    assert plan.kv_bytes_per_token(TINY, 1) == 2 * 2 * 2 * 16 * 2 and plan.kv_bytes_per_token(TINY, 2) == 128
    assert plan.kv_bytes_per_token(TINY, 4) == 128  # 2 KV heads over 4 ranks: replicated, one per rank


def test_tiny_qwen3_by_hand():
    # make_random_qwen3's shape: 4 heads / 2 KV heads of d=32 (hidden 64). One layer: q 128x64, k and v
    # 2 x 64x64 (no bias), o 64x128, gate/up/down 3 x 64x160, two norms 2 x 64, q/k norms 2 x 32
    spec = parse_spec(dict(model_type="qwen3", vocab_size=250, hidden_size=64, intermediate_size=160,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False))
    layer = 128 * 64 + 2 * 64 * 64 + 64 * 128 + 3 * 64 * 160 + 2 * 64 + 2 * 32
    assert plan.stage_params(spec, 1, 1, 0) == 2 * layer + 2 * 256 * 64 + 64
    assert plan.hf_param_count(spec) == 2 * layer + 2 * 250 * 64 + 64
    # the q/k norms add an fp32 1/rms per head, 4(a+g); torch's RMSNorm two fp32 copies of Q and K, 8(a+g)d
    sharded = 2 * (4 + 4) * 32 + 2 * (4 + 2) * 32 + 2 * 128 + 4 * 4 + 10 * 160 + 4 * (4 + 2)
    assert plan.layer_activation_bytes(spec, 1, 100) == 100 * (8 * 64 + sharded)
    assert plan.layer_activation_bytes(spec, 1, 100, te=False) == 100 * (20 * 64 + sharded + 8 * 6 * 32)
    assert plan.kv_bytes_per_token(spec, 1) == 2 * 2 * 2 * 32 * 2


def test_pipeline_first_stage_holds_every_layer_in_flight():
    spec = parse_spec(plan.SHAPES_DIR / "qwen2.5-14b.json")
    one = plan.layer_activation_bytes(spec, 2, 1000)
    first = plan.activation_bytes(spec, tp=2, pp=2, stage=0, tokens=1000, recompute=False)
    last = plan.activation_bytes(spec, tp=2, pp=2, stage=1, tokens=1000, recompute=False)
    assert first == 48 * one and last == 24 * one + 4 * spec.hidden_size * 1000


def test_padding_rule_is_megatrons():
    from megatron_ext.model import padded_vocab_size
    spec = parse_spec(plan.SHAPES_DIR / "qwen2.5-7b.json")
    for tp in (1, 2, 4, 8):
        assert plan.padded_vocab(spec, tp) == padded_vocab_size(spec, tp)
        assert plan.padded_vocab(TINY, tp) == padded_vocab_size(TINY, tp)


def _fitting_tps(cfg, world: int) -> list[int]:
    """The rollout TPs whose engines fit: weights plus one longest request's KV in the static
    budget, and weights beside the resident trainer in the sync phase."""
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
    # C6: every rank would build a TP-1 Qwen2.5-32B engine (65.5 GB) and a TP-2 one beside the trainer
    cfg = _shipped("qwen2.5-32b", "scheduler.planner.min_tp=1")
    p = plan.plan_memory(cfg, plan.resolve_spec(cfg)[0], world_size=64, device_bytes=DEVICE)
    tp1, tp2 = p.problems[:2]
    assert tp1.startswith("rollout engine TP 1: weights 65.53 GB") and "mem_fraction_static" in tp1
    assert tp2.startswith("rollout engine TP 2 in the sync phase") and "scheduler.planner.min_tp=4" in tp2
    assert _fitting_tps(cfg, 64) == [4, 8]
    with pytest.raises(ConfigError, match="rollout engine TP 1"):
        plan.check_memory(cfg, 64)


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
    assert logprobs.CHUNK_TOKENS == plan.LOGPROB_CHUNK_TOKENS
    monkeypatch.setattr(logprobs, "CHUNK_TOKENS", 256)
    monkeypatch.setattr(plan, "LOGPROB_CHUNK_TOKENS", 256)
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
    planned = plan.logits_bytes(spec, 1, tokens) - tokens * vocab * plan.BF16  # the logits existed before
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
