"""A few GRPO steps on the shipped policy raise its reward on a fixed evaluation set.

The loop is the real one in miniature (CPU, one process): the reference
engine samples R responses for P training prompts, the built-in task's
checker scores them, the Trainer takes a step, and the new weights go back
into the engine by HF name. The seed-to-seed noise of the evaluation is
measured in the same test, on the starting policy, and the improvement must
clear it by a wide margin. Skipped while the policy is not in the checkout.
"""
from __future__ import annotations

import statistics

import pytest
import torch

from rollpacker.testing import REPO_ROOT

POLICY = REPO_ROOT / "assets" / "policy"
DATA = REPO_ROOT / "assets" / "data"
pytestmark = pytest.mark.skipif(not (POLICY / "config.json").is_file(),
                                reason="the shipped policy (assets/policy) is not in this checkout")

MAX_STEPS_IN_PROMPT = 4  # short chains keep generation cheap; errors still compound over steps
PROMPTS, RESPONSES, STEPS = 16, 8, 6
EVAL_PROMPTS, EVAL_SEEDS = 48, (101, 102, 103, 104)


def _prompts(files, tokenizer, n: int, seed: int):
    from rollpacker.data.dataset import PromptDataset
    data = PromptDataset([str(f) for f in files], tokenizer, max_prompt_length=128, shuffle=True, seed=seed)
    short = [p for p in data.take(len(data)) if p.extra_info["num_steps"] <= MAX_STEPS_IN_PROMPT]
    return short[:n]


def _generate(engine, prompts, responses: int, seed: int, eos: int):
    from rollpacker.rollout.engine import GenerationRequest, SamplingParams
    from rollpacker.sample import Sample
    params = [SamplingParams(temperature=1.0, max_new_tokens=8 * MAX_STEPS_IN_PROMPT + 8, stop_token_ids=(eos,),
                             seed=seed * 100_003 + k) for k in range(len(prompts) * responses)]
    engine.submit([GenerationRequest(f"p{i}r{j}", p.input_ids, params[i * responses + j])
                   for i, p in enumerate(prompts) for j in range(responses)])
    done = {}
    while len(done) < len(params):
        for c in engine.poll(timeout=None):
            done[c.request_id] = c
    return [[Sample(prompt=p, response_index=j, response_ids=done[f"p{i}r{j}"].output_ids,
                    rollout_logprobs=done[f"p{i}r{j}"].logprobs, finish_reason=done[f"p{i}r{j}"].finish_reason)
             for j in range(responses)] for i, p in enumerate(prompts)]


def _score(groups, tokenizer):
    from rollpacker.examples.task import score_response
    for group in groups:
        for s in group:
            s.reward = float(score_response(tokenizer.decode(s.response_ids, skip_special_tokens=True),
                                            s.prompt.ground_truth)[0])
    return groups


def _eval_reward(engine, prompts, tokenizer, seed: int, eos: int) -> float:
    groups = _score(_generate(engine, prompts, 1, seed, eos), tokenizer)
    return statistics.fmean(g[0].reward for g in groups)


def test_grpo_steps_raise_reward_beyond_seed_noise():
    from transformers import PreTrainedTokenizerFast

    from megatron_ext.parallel import setup_layout, teardown_layout
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.reference import ReferenceEngine
    from rollpacker.trainer.config import TrainerConfig
    from rollpacker.trainer.trainer import Trainer

    torch.set_num_threads(1)
    # AutoTokenizer maps model_type qwen2 to Qwen2Tokenizer and ignores the saved word-level
    # pre-tokenizer (wrong ids); the class named in tokenizer_config.json loads it faithfully.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(POLICY)
    eos = tokenizer.eos_token_id
    engine = ReferenceEngine(POLICY, RolloutConfig(kv_cache_tokens=1 << 16, max_running_requests=512))
    eval_prompts = _prompts([DATA / "eval.jsonl"], tokenizer, EVAL_PROMPTS, seed=0)
    before = [_eval_reward(engine, eval_prompts, tokenizer, s, eos) for s in EVAL_SEEDS]
    noise = statistics.stdev(before)

    layout = setup_layout(1, 1, 1)
    try:
        trainer = Trainer(TrainerConfig(lr=3e-4, params_dtype="fp32", micro_batch_tokens=4096), POLICY, layout)
        train = _prompts([DATA / "train.jsonl"], tokenizer, PROMPTS * STEPS, seed=1)
        for step in range(STEPS):
            batch = _score(_generate(engine, train[step * PROMPTS:(step + 1) * PROMPTS], RESPONSES, step, eos),
                           tokenizer)
            metrics = trainer.train_step(batch)
            assert metrics["skipped"] == 0
            engine.update_weights(trainer.iter_hf_tensors())
    finally:
        teardown_layout(layout)
    after = [_eval_reward(engine, eval_prompts, tokenizer, s, eos) for s in EVAL_SEEDS]
    gain = statistics.fmean(after) - statistics.fmean(before)
    assert gain > max(4 * noise, 0.05), (before, after)
