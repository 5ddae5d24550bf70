"""The Trainer on the real Megatron Qwen2 model (CPU backend, one process).

NaN/Inf skips the step and keeps the weights; exact resume from state_dict;
the KL reference is swapped in and out bit-identically; engine log-probs feed
the ratio and the mismatch metric; padding does not change the numerics; the mismatch correction
drops rejected tokens from the loss and its denominator, and weights of 1 change nothing.
TP=2 against TP=1 and the pipeline schedule, over 2 torchrun ranks: tests/integration/test_trainer_procs.py.
"""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from megatron_ext.parallel import setup_layout, teardown_layout
from testkit import make_random_qwen2
from rollpacker.trainer.backend import logprobs_only, micro_batch_loss
from rollpacker.trainer.config import MismatchConfig, TrainerConfig
from rollpacker.trainer.packing import build_micro_batch, pack, sequence_length
from rollpacker.trainer.stream import with_advantages
from rollpacker.trainer.trainer import Trainer
from tests.dist.trainer_fixtures import random_groups


@pytest.fixture(scope="module")
def layout():
    torch.set_num_threads(1)
    layout = setup_layout(1, 1, 1)
    yield layout
    teardown_layout(layout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_qwen2(tmp_path_factory.mktemp("model"), seed=11)


def make(layout, model_dir, **overrides) -> Trainer:
    cfg = TrainerConfig(**{"lr": 1e-3, "params_dtype": "fp32", "micro_batch_tokens": 64, **overrides})
    return Trainer(cfg, model_dir, layout)


def params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def sequence_logprobs(trainer: Trainer, samples) -> list[torch.Tensor]:
    mb = build_micro_batch(samples, aggregation="token_mean", layout="padded")
    fn = partial(logprobs_only, tp_group=trainer.layout.tp_group, vocab_size=trainer.backend.vocab_size)
    [lp] = trainer.backend.forward_backward([mb], fn, forward_only=True)
    return [row[mask > 0] for row, mask in zip(lp, mb.loss_mask)]


def test_padding_does_not_change_logprobs(layout, model_dir):
    trainer = make(layout, model_dir)
    samples = [s.replace(advantage=1.0) for s in random_groups(0, num_groups=2, group_size=3)[1]]
    together = sequence_logprobs(trainer, samples)
    for s, lp in zip(samples, together):
        [alone] = sequence_logprobs(trainer, [s])
        assert torch.allclose(lp, alone, rtol=0, atol=1e-5)


def test_nan_or_inf_skips_the_step_and_training_continues(layout, model_dir):
    trainer = make(layout, model_dir)
    groups = random_groups(1, num_groups=2)
    before = params(trainer)
    opt_before = trainer.backend.optimizer.state_dict()["state"]

    nan_reward = [[s.replace(reward=float("nan")) if s.response_index == 0 else s for s in g] for g in groups]
    metrics = trainer.train_step(nan_reward)  # NaN advantages -> NaN loss
    assert metrics["skipped"] == 1 and trainer.steps == 0
    assert same(params(trainer), before) and trainer.backend.optimizer.state_dict()["state"] == opt_before

    param = next(trainer.model.parameters())
    hook = param.register_hook(lambda g: g * float("inf"))  # finite loss, Inf gradient
    metrics = trainer.train_step(groups)
    hook.remove()
    assert metrics["skipped"] == 1 and not torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert same(params(trainer), before)

    metrics = trainer.train_step(groups)
    assert metrics["skipped"] == 0 and trainer.steps == 1
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    assert not same(params(trainer), before)


def test_exact_resume_from_state_dict(layout, model_dir):
    trainer = make(layout, model_dir)
    g1, g2 = random_groups(2, num_groups=2), random_groups(3, num_groups=2)
    trainer.train_step(g1)
    state = trainer.state_dict()
    m2 = trainer.train_step(g2)
    after = params(trainer)

    fresh = make(layout, model_dir)
    fresh.load_state_dict(state)
    assert fresh.steps == 1
    m2_again = fresh.train_step(g2)
    for key in ("loss", "grad_norm", "entropy", "tokens"):
        assert m2_again[key] == m2[key]
    assert same(params(fresh), after)


def test_lr_warmup_ramps_the_rate_and_a_resumed_run_continues_the_ramp(layout, model_dir):
    trainer = make(layout, model_dir, lr=1e-3, lr_warmup_steps=4)
    before = params(trainer)
    first = trainer.train_step(random_groups(2, num_groups=2))
    # Adam's first bias-corrected update moves each weight by lr * |g| / (|g| + eps): at most lr
    moved = max((a - b).abs().max().item() for a, b in zip(params(trainer), before))
    print(f"step 1 at lr {first['lr']:.2e}: largest weight change {moved:.3e}")
    assert first["lr"] == pytest.approx(2.5e-4)
    assert 0.9 * 2.5e-4 < moved <= 2.5e-4 * (1 + 1e-5)
    assert trainer.train_step(random_groups(3, num_groups=2))["lr"] == pytest.approx(5e-4)
    state = trainer.state_dict()

    resumed = make(layout, model_dir, lr=1e-3, lr_warmup_steps=4)
    resumed.load_state_dict(state)
    rates = [resumed.train_step(random_groups(4 + i, num_groups=2))["lr"] for i in range(3)]
    assert rates == pytest.approx([7.5e-4, 1e-3, 1e-3])
    with pytest.raises(Exception, match="lr_warmup_steps"):
        TrainerConfig(lr=1e-3, lr_warmup_steps=-1).validate()


def test_kl_reference_is_swapped_in_and_out(layout, model_dir):
    trainer = make(layout, model_dir, kl_coef=0.5, lr=1e-2)
    groups = random_groups(4, num_groups=2)
    first = trainer.train_step(groups)
    assert first["kl"] == pytest.approx(0.0, abs=1e-12)  # policy == reference before any update
    current = params(trainer)
    with trainer.backend.swapped_params(trainer.stream.reference):
        assert same(params(trainer), [trainer.stream.reference[n] for n, _ in trainer.model.named_parameters()])
    assert same(params(trainer), current)  # swapped back bit-identically
    second = trainer.train_step(groups)
    assert second["kl"] > 1e-6
    assert second["loss"] != pytest.approx(second["pg_loss"])  # the penalty is part of the loss


def test_kl_reference_forward_builds_no_autograd_graph(layout, model_dir, monkeypatch):
    """The reference policy's forward is forward-only on every backend: no graph, no saved activations
    (Megatron's schedule does not disable grad by itself in forward-only mode)."""
    trainer = make(layout, model_dir, kl_coef=0.5)
    seen = []
    real = trainer.backend.forward_backward

    def recording(mbs, fn, *, forward_only=False):
        seen.append((forward_only, torch.is_grad_enabled()))
        return real(mbs, fn, forward_only=forward_only)

    monkeypatch.setattr(trainer.backend, "forward_backward", recording)
    trainer.train_step(random_groups(4, num_groups=2))
    assert (True, False) in seen and (False, True) in seen  # reference pass without grad, training pass with
    assert all(not grad for forward_only, grad in seen if forward_only)


def test_engine_logprobs_drive_the_ratio_and_the_mismatch_metric(layout, model_dir):
    recompute = make(layout, model_dir)
    engine = make(layout, model_dir, old_logprobs="engine")
    groups = random_groups(5, num_groups=2)
    exact = []
    for g in groups:
        with_adv = with_advantages(g, recompute.cfg)
        lps = sequence_logprobs(recompute, with_adv)
        exact.append([s.replace(rollout_logprobs=lp.tolist()) for s, lp in zip(g, lps)])
    ref = recompute.train_step(exact)
    same_policy = engine.train_step(exact)
    assert same_policy["logprob_mismatch"] == pytest.approx(0.0, abs=1e-5)
    assert same_policy["loss"] == pytest.approx(ref["loss"], abs=1e-5)

    shifted = [[s.replace(rollout_logprobs=[x + 0.4 for x in s.rollout_logprobs]) for s in g] for g in exact]
    off_policy = make(layout, model_dir, old_logprobs="engine").train_step(shifted)
    assert off_policy["logprob_mismatch"] == pytest.approx(0.4, abs=1e-4)
    assert off_policy["clip_frac"] > 0  # ratio exp(-0.4) = 0.67 clips the negative-advantage tokens

    no_logprobs = make(layout, model_dir, old_logprobs="engine")
    with pytest.raises(ValueError, match="old_logprobs=engine"):
        no_logprobs.train_step(groups)


def optimizer_tensors(trainer: Trainer) -> list[torch.Tensor]:
    return [t for state in trainer.backend.optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor)]


def names_of(trainer: Trainer) -> list[str]:
    """The weight push's tensors, read while the trainer is in the sync phase."""
    return [n for n, _ in trainer.iter_hf_tensors()]


def test_offload_releases_the_state_and_onload_restores_it_exactly(layout, model_dir, tmp_path):
    """Offload frees the storage of every param, grad and Adam tensor and reports those bytes; onload
    brings params and optimizer state back bit-identical and grads as zeros, so the next step equals
    that of a trainer that never offloaded, also when the optimizer's state goes first (the sync
    phase); the HF export of the result round-trips."""
    trainer, control = make(layout, model_dir), make(layout, model_dir)
    for t in (trainer, control):
        t.train_step(random_groups(6, num_groups=2))
    weights, moments = params(trainer), [t.clone() for t in optimizer_tensors(trainer)]
    grads = [p.grad for p in trainer.model.parameters()]
    assert all(g is not None for g in grads) and any(bool(g.any()) for g in grads)
    resident = list(trainer.model.parameters()) + grads + optimizer_tensors(trainer)
    size = sum(t.untyped_storage().nbytes() for t in resident)

    offloaded = trainer.offload()
    assert offloaded.bytes == size and offloaded.seconds >= 0
    assert [t.untyped_storage().nbytes() for t in resident] == [0] * len(resident)
    with pytest.raises(RuntimeError, match="twice"):
        trainer.offload()

    onloaded = trainer.onload()
    assert onloaded.bytes == size
    assert same(params(trainer), weights) and same(optimizer_tensors(trainer), moments)
    assert all(p.grad is g and not g.any() for p, g in zip(trainer.model.parameters(), grads))
    with pytest.raises(RuntimeError, match="without an offload"):
        trainer.onload()

    for t in (trainer, control):
        t.train_step(random_groups(7, num_groups=2))
    assert same(params(trainer), params(control)) and not same(params(trainer), weights)
    assert same(optimizer_tensors(trainer), optimizer_tensors(control))
    # in stages, as a step's sync and rollout do: the optimizer's state and the grads first, the
    # params (which the weight push reads) staying; then the params; one onload brings back both
    moments = [t.clone() for t in optimizer_tensors(trainer)]
    staged = trainer.backend.offload_optimizer()
    assert staged.bytes == sum(t.nbytes for t in moments) + sum(g.nbytes for g in grads)
    assert same(params(trainer), params(control)) and names_of(trainer) == names_of(control)
    assert all(t.untyped_storage().nbytes() == 0 for t in optimizer_tensors(trainer))
    assert trainer.offload().bytes == sum(p.nbytes for p in trainer.model.parameters())
    trainer.onload()  # after a step: what comes back is the new state, not the first copy's
    assert same(params(trainer), params(control)) and same(optimizer_tensors(trainer), moments)
    for t in (trainer, control):
        t.train_step(random_groups(8, num_groups=2))
    assert same(params(trainer), params(control))
    trainer.save_hf(tmp_path / "hf")
    reloaded = Trainer(trainer.cfg, tmp_path / "hf", layout)
    assert same(params(reloaded), params(control))
    names = [n for n, _ in trainer.iter_hf_tensors()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


def test_bad_settings_are_refused(layout, model_dir):
    with pytest.raises(ValueError, match="trainer.tp/pp/cp"):
        make(layout, model_dir, tp=2)
    with pytest.raises(ValueError, match="params_dtype=fp32"):
        make(layout, model_dir, params_dtype="bf16")
    trainer = make(layout, model_dir)
    with pytest.raises(RuntimeError, match="begin"):
        trainer.stream.consume(random_groups(0, num_groups=1))
    trainer.stream.begin()
    with pytest.raises(ValueError, match="has no reward"):
        trainer.stream.consume([[s.replace(reward=None) for s in random_groups(0, num_groups=1)[0]]])


# -- the engine-trainer mismatch: its correction in the real trainer (the maths: test_mismatch.py) ----------------------------------------------------------------------------------


def engine_equals_trainer(trainer, groups):
    """``groups`` whose engine log-probs are the trainer's own, computed on the micro-batches the step
    will train (one replica: the samples in group order, packed as the trainer packs them): every
    importance weight is exactly 1."""
    cfg = trainer.cfg
    samples = [s for g in groups for s in with_advantages(g, cfg)]
    fn = partial(logprobs_only, tp_group=trainer.layout.tp_group, vocab_size=trainer.backend.vocab_size)
    lps = [None] * len(samples)
    for rows in pack([sequence_length(s) for s in samples], cfg.micro_batch_tokens, "padded"):
        mb = build_micro_batch([samples[i] for i in rows], aggregation=cfg.loss_aggregation, layout="padded")
        [lp] = trainer.backend.forward_backward([mb], fn, forward_only=True)
        for i, row, mask in zip(rows, lp, mb.loss_mask):
            lps[i] = row[mask > 0].tolist()
    it = iter(lps)
    return [[s.replace(rollout_logprobs=next(it)) for s in g] for g in groups]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_rejected_responses_leave_the_step_as_if_never_sampled(layout, model_dir, aggregation):
    """Sequence-level masked IS: one group's engine log-probs equal the trainer's (weight 1, kept), the
    other group's are 3 nats off per token (rejected). The update equals a step on the kept group alone,
    so the rejected tokens are out of the loss and out of its denominator."""
    kw = dict(micro_batch_tokens=10_000, loss_aggregation=aggregation)
    corrected = make(layout, model_dir, mismatch=MismatchConfig(correct="sequence", mode="mask"), **kw)
    kept, rejected = engine_equals_trainer(corrected, random_groups(7, num_groups=2, group_size=3))
    rejected = [s.replace(rollout_logprobs=[x - 3.0 for x in s.rollout_logprobs]) for s in rejected]
    m = corrected.train_step([kept, rejected])
    alone = make(layout, model_dir, **kw)
    ref = alone.train_step([kept])
    print(f"{aggregation}: corrected tokens {m['tokens']} seqs {m['sequences']} loss {m['loss']:.6f}; "
          f"kept group alone tokens {ref['tokens']} loss {ref['loss']:.6f}")
    assert (m["tokens"], m["sequences"]) == (ref["tokens"], ref["sequences"]) == (
        sum(len(s.response_ids) for s in kept), len(kept))
    assert m["mismatch/kept_token_frac"] < 1 and m["mismatch/is_weight_mean"] == 1.0
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for a, b in zip(params(corrected), params(alone)):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)  # Adam: lr * g / (|g| + eps), a tiny g moves 1e-7


def test_a_step_with_every_token_rejected_is_skipped(layout, model_dir):
    trainer = make(layout, model_dir, mismatch=MismatchConfig(correct="token", mode="mask"))
    groups = [[s.replace(rollout_logprobs=[x - 3.0 for x in s.rollout_logprobs]) for s in g]
              for g in engine_equals_trainer(trainer, random_groups(7, num_groups=2, group_size=3))]
    before = params(trainer)
    m = trainer.train_step(groups)
    assert m["skipped"] == 1 and m["tokens"] == 0 and m["mismatch/kept_token_frac"] == 0
    # the weight-sync check still sees the rejected tokens: a missed sync cannot hide behind a correction
    assert m["logprob_mismatch"] == pytest.approx(3.0) and m["logprob_mismatch_max"] == pytest.approx(3.0)
    assert all(torch.equal(a, b) for a, b in zip(params(trainer), before))


def test_weights_of_one_change_nothing_and_the_diagnostics_read_zero(layout, model_dir):
    plain = make(layout, model_dir)
    truncated = make(layout, model_dir, mismatch=MismatchConfig(correct="token"))
    groups = engine_equals_trainer(plain, random_groups(3, num_groups=2, group_size=3))
    a, b = plain.train_step(groups), truncated.train_step(groups)
    assert a["mismatch/kl_k3"] == 0 and a["mismatch/chi2_token"] == 0 and a["mismatch/ppl_ratio"] == 1
    assert b["mismatch/is_weight_mean"] == 1.0 and a["loss"] == b["loss"]
    assert all(torch.equal(x, y) for x, y in zip(params(plain), params(truncated)))


def test_seq_mean_divides_each_response_by_its_kept_tokens(layout, model_dir):
    """The denominator case slime's #657 fixed: with token-level masking and a per-response mean, a
    response's loss is divided by the tokens it kept, not by its length. The current policy is the
    behaviour policy (ratio 1), so each kept token contributes -A * w / kept(response)."""
    trainer = make(layout, model_dir, loss_aggregation="seq_mean",
                   mismatch=MismatchConfig(correct="token", mode="mask", high=1.5))
    [group] = engine_equals_trainer(trainer, random_groups(4, num_groups=1, group_size=4, response_len=(6, 12)))
    shift = [0.0, 1.0, 0.1, -0.2]  # per token, cycling: exp(-1) is rejected, the others kept with weight exp(-shift)
    group = [s.replace(rollout_logprobs=[x + shift[i % 4] for i, x in enumerate(s.rollout_logprobs)]) for s in group]
    samples = with_advantages(group, trainer.cfg)
    mb = build_micro_batch(samples, aggregation="seq_mean", layout="padded")
    fn = partial(micro_batch_loss, cfg=trainer.cfg, tp_group=layout.tp_group, vocab_size=trainer.backend.vocab_size)
    [sums] = trainer.backend.forward_backward([mb], fn, forward_only=True)
    loss = sums.objective
    expected = 0.0
    for s in samples:
        weights = [math.exp(-shift[i % 4]) for i in range(len(s.response_ids)) if shift[i % 4] != 1.0]
        expected += sum(-s.advantage * w for w in weights) / len(weights)
    print(f"objective {float(loss):.8f}, by hand {expected:.8f}")
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert int(sums.tokens) == sum(len([i for i in range(len(s.response_ids)) if i % 4 != 1]) for s in samples)
