"""rollout.match_trainer: the engine samples from exactly the policy the CPU trainer computes.

The real Megatron model on both sides (random tiny Qwen2 and Qwen3), the real trainer step, the
real weight sync path (HF tensors in buckets): the engine's log-probs equal the trainer's bit for
bit, before and after training, whatever the engine's batch held. The reference engine on the
same weights shows the gap this mode removes.
"""
from __future__ import annotations

import pytest
import torch

from rollpacker.config import Config, check_layout
from rollpacker.configlib import ConfigError, build
from rollpacker.rollout import make_engine
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.sample import Prompt, Sample
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.trainer import Trainer
from testkit import make_random_qwen2, make_random_qwen3
from tests.dist.megatron_fixtures import layout  # noqa: F401  (pytest fixture)

WINDOW = 40
GROUP = 4


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    make = make_random_qwen2 if request.param == "qwen2" else make_random_qwen3
    return make(tmp_path_factory.mktemp(request.param), seed=5)


def rollout(engine, prompts: list[list[int]], *, seed: int) -> list[list[Sample]]:
    """``GROUP`` sampled responses per prompt, submitted together (so batches mix prompts and the
    running set changes as responses finish), rewarded 1 on odd response indices."""
    params = SamplingParams(temperature=1.0, max_new_tokens=WINDOW - max(map(len, prompts)), stop_token_ids=(3,))
    engine.submit([GenerationRequest(f"{u}-{i}", ids, params.with_seed(seed * 1000 + u * GROUP + i))
                   for u, ids in enumerate(prompts) for i in range(GROUP)])
    done = {}
    while engine.active_request_ids():
        done.update({c.request_id: c for c in engine.poll(timeout=None)})
    groups = []
    for u, ids in enumerate(prompts):
        prompt = Prompt(uid=u, input_ids=ids, data_source="synthetic")
        groups.append([Sample(prompt=prompt, response_index=i, response_ids=list(done[f"{u}-{i}"].output_ids),
                              rollout_logprobs=list(done[f"{u}-{i}"].logprobs), finish_reason="stop",
                              reward=float(i % 2)) for i in range(GROUP)])
    return groups


PROMPTS = [[5, 17, 9], [100, 2, 44, 7, 8, 12, 60], [33, 21], [8, 9, 10, 11, 12]]


def test_engine_and_trainer_log_probs_are_bit_equal_before_and_after_training(layout, model_dir):
    engine = make_engine(RolloutConfig(match_trainer=True, max_running_requests=5, seed=3), model_dir,
                         window=WINDOW)
    cfg = TrainerConfig(lr=1e-2, params_dtype="fp32", micro_batch_tokens=3 * WINDOW)
    trainer = Trainer(cfg, model_dir, layout, row_width=WINDOW)
    for step in range(3):
        groups = rollout(engine, PROMPTS, seed=step)
        tokens = sum(len(s.response_ids) for g in groups for s in g)
        metrics = trainer.train_step(groups)
        print(f"step {step}: {tokens} response tokens, kl_k1 {metrics['mismatch/kl_k1']!r}, "
              f"kl_k3 {metrics['mismatch/kl_k3']!r}, max |dlogp| {metrics['logprob_mismatch_max']!r}, "
              f"grad norm {metrics['grad_norm']:.3f}")
        assert metrics["mismatch/tokens"] == tokens > 0 and metrics["skipped"] == 0
        assert metrics["logprob_mismatch_max"] == 0.0
        assert metrics["mismatch/kl_k1"] == metrics["mismatch/kl_k3"] == 0.0
        assert metrics["mismatch/chi2_token"] == metrics["mismatch/chi2_seq"] == 0.0
        assert metrics["mismatch/ppl_ratio"] == 1.0
        engine.release_memory(["weights"])  # as the program does: released, resumed, refilled by the sync
        engine.resume_memory(["weights"])
        hf = list(trainer.iter_hf_tensors())
        for a in range(0, len(hf), 3):  # in buckets that split q/k/v and gate/up across calls
            engine.update_weights(hf[a:a + 3])
        assert engine.max_weight_diff(hf) == 0.0


def test_the_reference_engine_on_the_same_weights_has_a_gap(layout, model_dir):
    """What the mode removes: the KV-cached engine's log-probs differ from the trainer's in the last bits."""
    reference = make_engine(RolloutConfig(max_running_requests=5, seed=3), model_dir)
    trainer = Trainer(TrainerConfig(lr=1e-2, params_dtype="fp32", micro_batch_tokens=3 * WINDOW), model_dir, layout)
    metrics = trainer.train_step(rollout(reference, PROMPTS, seed=0))
    print(f"reference engine: kl_k3 {metrics['mismatch/kl_k3']:.3e}, max |dlogp| {metrics['logprob_mismatch_max']:.3e}")
    assert 0.0 < metrics["logprob_mismatch_max"] < 1e-4


def test_an_evicted_request_continues_as_if_it_had_not_moved(layout, model_dir):
    cfg = RolloutConfig(match_trainer=True, max_running_requests=4, seed=3)
    one, other = (make_engine(cfg, model_dir, window=WINDOW, engine_id=i) for i in range(2))
    params = SamplingParams(max_new_tokens=20, seed=99)
    request = GenerationRequest("r", PROMPTS[1], params)
    one.submit([request])
    [whole] = one.poll(timeout=None)
    one.submit([request])
    for _ in range(7):
        one.poll(timeout=0)
    [partial] = one.evict(["r"])
    assert len(partial.output_ids) == 7 and not one.active_request_ids()
    other.submit([request.resumed_from(partial)])
    [moved] = other.poll(timeout=None)
    assert list(moved.output_ids) == list(whole.output_ids) and list(moved.logprobs) == list(whole.logprobs)


def test_requests_that_do_not_fit_the_window_are_refused(layout, model_dir):
    engine = make_engine(RolloutConfig(match_trainer=True), model_dir, window=WINDOW)
    with pytest.raises(ValueError, match="window of 40 tokens"):
        engine.submit([GenerationRequest("long", PROMPTS[0], SamplingParams(max_new_tokens=WINDOW))])


@pytest.mark.parametrize("overrides, message", [
    ({"rollout": {"backend": "sglang"}}, "backend='sglang'"),
    ({"rollout": {"dtype": "bf16"}}, "dtype='bf16'"),
    ({"rollout": {"tp": 2}}, r"rollout TP 1 in every round \(got \[2\]"),
    ({"scheduler": {"planner": {"enabled": True, "long_tp": 2, "max_tp": 2}}}, r"got \[1, 2\]"),
    ({"trainer": {"tp": 2}}, "trainer.tp=pp=cp=1"),
])
def test_layouts_the_mode_cannot_match_are_refused(tmp_path, overrides, message):
    data = {"rollout": {"match_trainer": True}, "model": {"path": str(tmp_path)},
            "scheduler": {"planner": {"enabled": False}}}
    check_layout(build(Config, data, where="", source="t.yaml"), 4, require_files=False)
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError, match=message):
        check_layout(build(Config, data, where="", source="t.yaml"), 4, require_files=False)


def test_a_row_depends_on_the_padded_width_not_on_later_tokens_or_other_rows(layout, model_dir):
    """Why the mode fixes the width: what this CPU's Megatron forward is and is not invariant to."""
    from megatron_ext.matched import TrainerForward
    forward = TrainerForward(model_dir, 64)
    seq = [(7 * i + 3) % 200 for i in range(64)]
    full = forward.logits([seq])[0]
    padded = sum(not torch.equal(forward.logits([seq[:t + 1]])[0, :t + 1], full[:t + 1]) for t in range(8, 64))
    batched = not torch.equal(forward.logits([seq, seq[::-1], seq[:9]])[0], full)
    unpadded = 0
    for t in range(8, 64):
        forward.window = t + 1
        unpadded += not torch.equal(forward.logits([seq[:t + 1]])[0, t], full[t])
    print(f"of 56 prefixes: {padded} differ padded to the width, {unpadded} differ unpadded; batch changes "
          f"a row: {batched}")
    assert padded == 0 and not batched
    assert unpadded > 0  # this is what the fixed width is for
