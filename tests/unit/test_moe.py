"""Qwen3-MoE in one process: what its config.json means, what is refused and where, and that the
router's load-balancing loss is part of the trainer's objective. The model over 2 ranks (EP=2,
TP=2, PP=2): tests/integration/test_convert_procs.py and test_trainer_procs.py; the reference
engine: test_engine_moe.py; the program: test_train_program.py."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_ext.conversion import verify
from rollpacker.config import check_layout, load_config
from rollpacker.configlib import ConfigError
from rollpacker.hf_spec import parse_spec
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.packing import plan_micro_batches
from rollpacker.trainer.trainer import Trainer
from testkit import REPO_ROOT, make_random_qwen3_moe
from tests.dist.trainer_fixtures import random_groups
from tests.unit.test_trainer import layout  # noqa: F401 - the same fixture

# 10x the measured |dlogp| (4.8e-7) and |dH| (1.4e-6) against transformers in fp32
LOGPROB_TOL, ENTROPY_TOL = 5e-6, 2e-5


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_random_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"), seed=2)


def _config(moe_dir) -> dict:
    return json.loads((moe_dir / "config.json").read_text())


def test_the_spec_reads_experts_sparse_layers_and_refuses_other_variants(moe_dir):
    spec = parse_spec(moe_dir)
    print(spec)
    assert (spec.num_experts, spec.experts_per_token, spec.moe_intermediate_size) == (8, 2, 32)
    assert spec.norm_topk_prob and spec.moe_layers == (0, 2) and spec.router_aux_loss_coef == 0.001
    shapes = spec.hf_shapes()
    assert shapes["model.layers.0.mlp.gate.weight"] == (8, 64) and "model.layers.1.mlp.gate_proj.weight" in shapes
    assert shapes["model.layers.2.mlp.experts.7.down_proj.weight"] == (64, 32)
    published = {**_config(moe_dir), "num_experts": 128, "decoder_sparse_step": 2, "mlp_only_layers": []}
    published.pop("num_local_experts")  # the hub's checkpoints write num_experts
    assert parse_spec(published).moe_layers == (1,) and parse_spec(published).num_experts == 128
    for change, message in ((dict(shared_expert_intermediate_size=64), "shared experts"),
                            (dict(scoring_func="sigmoid"), "softmax top-k router"),
                            (dict(num_experts_per_tok=9), "between 1 and num_experts")):
        with pytest.raises(ValueError, match=message):
            parse_spec({**_config(moe_dir), **change})
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by expert-parallel size 3"):
        spec.check_ep(3)
    with pytest.raises(ValueError, match="no experts"):
        parse_spec(REPO_ROOT / "assets" / "policy").check_ep(2)


def test_megatron_matches_transformers_at_ep1(moe_dir, layout):  # noqa: F811
    parity = verify(moe_dir, layout)
    print(f"max |dlogp| {parity.logprob_diff:.2e}, max |dH| {parity.entropy_diff:.2e}")
    assert parity.logprob_diff < LOGPROB_TOL and parity.entropy_diff < ENTROPY_TOL


def test_expert_layouts_the_trainer_or_sglang_cannot_run_are_refused_before_work(moe_dir, tmp_path):
    def cfg(*overrides, model=moe_dir):
        return load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml", [f"model.path={model}", *overrides])

    check_layout(cfg("trainer.ep=2", "trainer.stream=false"), 2)
    check_layout(cfg("trainer.tp=2"), 2)  # under sequence parallelism (megatron_ext/model.py)
    # sglang reports routing (sglang_routing.py), on the all-sparse checkpoints it can serve
    all_sparse = make_random_qwen3_moe(tmp_path / "all_sparse", seed=2, mlp_only_layers=[])
    check_layout(cfg("rollout.backend=sglang", "trainer.routing_replay=true", "rollout.return_routing=true",
                     model=all_sparse), 2)
    for overrides, world, message in (
            (["trainer.ep=2"], 2, r"trainer.ep=2 with trainer.stream=true: .*set trainer.stream=false"),
            (["trainer.ep=4", "trainer.stream=false"], 2, r"trainer.ep=4: .*does not divide the world size 2"),
            (["trainer.ep=3", "trainer.stream=false", "scheduler.p0=6"], 6,
             r"num_experts=8 is not divisible by expert-parallel size 3"),
            (["rollout.backend=sglang"], 2, r"dense layers \[1\] .*sglang builds every Qwen3-MoE layer sparse"),
            (["trainer.routing_replay=true"], 2, r"routing_replay=true: .*set rollout.return_routing=true"),
            (["trainer.routing_replay=true", "rollout.return_routing=true", "trainer.recompute=true"], 2,
             r"routing_replay=true: a recomputed forward"),
            # the rollout engines' expert parallelism: 8 experts, 96 wide
            (["scheduler.planner.short_ep=16", "scheduler.planner.max_tp=16", "scheduler.p0=8"], 16,
             r"rollout engines of TP 16 EP 16 .*EP 16 does not divide the 8 experts")):
        with pytest.raises(ConfigError, match=message):
            check_layout(cfg(*overrides), world)
    dense = load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml", ["trainer.ep=2", "trainer.stream=false"])
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        check_layout(dense, 2)
    dense = load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml", ["scheduler.planner.long_ep=2"])
    with pytest.raises(ConfigError, match=r"rollout engines of TP 2 EP 2 .*the model has no experts to split \(qwen2\)"):
        check_layout(dense, 2)
    check_layout(cfg("scheduler.planner.long_ep=2", "scheduler.planner.short_ep=2"), 2)
    narrow = make_random_qwen3_moe(tmp_path / "narrow", seed=2, moe_intermediate_size=90)
    with pytest.raises(ConfigError, match=r"rollout engines of TP 4 \(.*\): the 4 ranks sharing an expert do not "
                                          r"divide its intermediate size 90"):
        check_layout(cfg("scheduler.planner.max_tp=4", "scheduler.p0=4", model=narrow), 4)


def test_sglang_on_cpu_refuses_expert_parallel_engines_before_any_starts(moe_dir, monkeypatch):
    """sglang's plain-torch MoE, the one a CPU engine runs, indexes the -1 that marks another rank's
    expert under EP (measured with 0.5.23 at TP 2 / EP 2: "index -1 is out of bounds" at the first
    forward; TP 2 / EP 1 gave 48/48 tokens equal to transformers)."""
    import importlib.util

    from rollpacker.runtime import preflight
    real = importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real(name, *a))
    base = [f"model.path={moe_dir}", "rollout.backend=sglang"]
    preflight.check_backends(load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml", base))
    for keys in (["scheduler.planner.enabled=false", "rollout.tp=2", "rollout.ep=2"],
                 ["scheduler.planner.short_ep=2"], ["scheduler.planner.long_ep=2"]):
        with pytest.raises(ConfigError, match=r"rollout EP 2 .*sglang engine on CPU runs its plain-torch MoE"):
            preflight.check_backends(load_config(REPO_ROOT / "configs" / "tiny-cpu.yaml", [*base, *keys]))


def test_the_load_balancing_loss_is_in_the_objective(moe_dir, layout):  # noqa: F811
    """Zero advantages leave only the router's load-balancing loss: its gradient reaches the
    routers alone and scales with trainer.moe_aux_loss_coef (0: none)."""
    def router_grads(coef: float) -> dict[str, torch.Tensor]:
        trainer = Trainer(TrainerConfig(params_dtype="fp32", micro_batch_tokens=64, moe_aux_loss_coef=coef),
                          moe_dir, layout)
        samples = [s for g in random_groups(8, num_groups=2) for s in g]
        for s in samples:
            s.advantage = 0.0
        mbs = plan_micro_batches(samples, budget=64, aggregation="token_mean", layout="padded")
        trainer.backend.zero_grad()
        trainer.backend.forward_backward(mbs, trainer.stream._loss_fn)
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    off, on, double = router_grads(0.0), router_grads(0.01), router_grads(0.02)
    routers = [n for n in on if "router" in n]
    print({n: float(on[n].norm()) for n in routers})
    assert routers and all(float(off[n].abs().max()) == 0.0 for n in on)
    assert all(float(on[n].norm()) > 0 for n in routers)
    for n in routers:
        torch.testing.assert_close(double[n], 2 * on[n], rtol=1e-5, atol=1e-12)


def test_the_trainer_replays_the_engines_routing(moe_dir, layout):  # noqa: F811
    """Samples from the reference engine with their routing (rollout.return_routing): the trainer with
    trainer.routing_replay computes every response token's log-prob through the engine's experts.
    In fp32 the two route alike, so replay changes nothing and both match the engine; replaying other
    experts (each choice moved to the next expert) changes the log-probs, so the routing is used."""
    from rollpacker.rollout import make_engine
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.engine import GenerationRequest, SamplingParams
    from rollpacker.sample import Prompt, Sample
    from tests.unit.test_engine import _run

    engine = make_engine(RolloutConfig(return_routing=True, seed=1), moe_dir)
    prompts = [[(7 * i + j) % 250 for j in range(3 + 2 * i)] for i in range(4)]
    done = _run(engine, [GenerationRequest(f"r{i}", p, SamplingParams(temperature=1.0, max_new_tokens=12, seed=i))
                         for i, p in enumerate(prompts)])
    samples = [Sample(Prompt(uid=i, input_ids=p, data_source="t"), 0, response_ids=list(done[f"r{i}"].output_ids),
                      rollout_logprobs=list(done[f"r{i}"].logprobs), routed_experts=done[f"r{i}"].routed_experts,
                      advantage=0.0) for i, p in enumerate(prompts)]
    spec = parse_spec(moe_dir)
    trainer = Trainer(TrainerConfig(params_dtype="fp32", routing_replay=True), moe_dir, layout)

    def logprobs(shift: int | None) -> torch.Tensor:
        mbs = plan_micro_batches(samples, budget=4096, aggregation="token_mean", layout="padded",
                                 experts=(len(spec.moe_layers), spec.experts_per_token))
        for mb in mbs:
            mb.routing = None if shift is None else (mb.routing + shift) % spec.num_experts
        (out,) = trainer.backend.forward_backward(mbs, trainer.stream._ref_fn, forward_only=True)
        return out[mbs[0].loss_mask > 0]

    engine_lp = torch.cat([torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples])
    own, replay, other = logprobs(None), logprobs(0), logprobs(1)
    print(f"max |replay - own| {float((replay - own).abs().max()):.2e}, max |replay - engine| "
          f"{float((replay - engine_lp).abs().max()):.2e}, max |other experts - own| {float((other - own).abs().max()):.2e}")
    assert float((replay - own).abs().max()) < 1e-6 and float((replay - engine_lp).abs().max()) < LOGPROB_TOL
    assert float((other - own).abs().max()) > 1e-2
