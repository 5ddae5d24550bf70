"""Quality figures of a starting policy on the built-in task.

    python -m rollpacker.examples.policy_report [--policy assets/policy] [--data assets/data/eval.jsonl]

Samples ``n`` responses per held-out prompt at temperature 1.0 and reports
what tail batching and GRPO need from a starting policy:

- pass@1 (mean correctness over all responses) -- GRPO needs groups that are
  neither all right nor all wrong;
- max / median response length over the whole batch, and over each training
  step's worth of prompts -- the long tail;
- Spearman correlation, over prompts, of the mean response length in two
  independent halves of the samples -- length is a property of the prompt;
- the standard deviation of log length within a prompt -- how much responses
  to one prompt differ (published reasoning traces: ~0.65).

``report_from_lengths`` takes plain per-prompt lists, so a rollout engine's
samples are scored the same way as the transformers sampler used here.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rollpacker.data.dataset import PromptDataset
from rollpacker.examples.task import score_response
from rollpacker.sample import Prompt
from rollpacker.stats import spearman


@dataclass(frozen=True)
class PolicyReport:
    num_prompts: int
    responses_per_prompt: int
    pass_at_1: float
    median_length: float
    max_length: int
    max_over_median: float
    length_spearman: float  # per-prompt mean length, first half of samples vs second half
    step_max_over_median: float  # mean over runs of STEP_PROMPTS prompts (in file order)
    within_prompt_log_sd: float  # mean over prompts of the std of log(length) among its responses

    def summary(self) -> str:
        return (f"{self.num_prompts} prompts x {self.responses_per_prompt} responses: "
                f"pass@1 {self.pass_at_1:.3f}, median length {self.median_length:.0f}, "
                f"max length {self.max_length}, max/median {self.max_over_median:.1f} "
                f"({self.step_max_over_median:.1f} per {STEP_PROMPTS} prompts), "
                f"length Spearman (halves) {self.length_spearman:.3f}, "
                f"sigma of log length within a prompt {self.within_prompt_log_sd:.2f}")


STEP_PROMPTS = 16  # the example's prompts per step (scheduler.p0)


def report_from_lengths(lengths: list[list[int]], correct: list[list[bool]]) -> PolicyReport:
    """Figures from per-prompt response lengths (tokens) and correctness, ``n`` (even) per prompt."""
    n = len(lengths[0])
    if n < 2 or n % 2 or any(len(row) != n for row in lengths) or len(correct) != len(lengths):
        raise ValueError("need the same even number (>= 2) of responses for every prompt")
    flat = [length for row in lengths for length in row]
    median = statistics.median(flat)
    half = n // 2
    steps = [[x for row in lengths[i:i + STEP_PROMPTS] for x in row] for i in range(0, len(lengths), STEP_PROMPTS)]
    return PolicyReport(
        num_prompts=len(lengths), responses_per_prompt=n,
        pass_at_1=statistics.fmean(float(c) for row in correct for c in row),
        median_length=median, max_length=max(flat), max_over_median=max(flat) / median,
        length_spearman=spearman([statistics.fmean(row[:half]) for row in lengths],
                                 [statistics.fmean(row[half:]) for row in lengths]),
        step_max_over_median=statistics.fmean(max(step) / statistics.median(step) for step in steps),
        within_prompt_log_sd=statistics.fmean(statistics.pstdev([math.log(x) for x in row]) for row in lengths),
    )


def _sample_batch(model, rows: list[list[int]], *, eos_token_id: int, temperature: float,
                  max_new_tokens: int) -> list[list[int]]:
    """Sample one response per row: left-padded prefill, then one token a step from the KV cache.

    A plain loop over the model's forward: ``generate`` spends more time in
    per-step bookkeeping than in this tiny model.
    """
    from transformers import DynamicCache

    longest = max(map(len, rows))
    input_ids = torch.full((len(rows), longest), eos_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):
        input_ids[i, longest - len(ids):] = torch.tensor(ids)
        mask[i, longest - len(ids):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out_tokens = torch.full((len(rows), max_new_tokens), eos_token_id, dtype=torch.long)
    done = torch.zeros(len(rows), dtype=torch.bool)
    for step in range(max_new_tokens):
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits[:, -1]
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        token = torch.multinomial(probs, 1).squeeze(-1).masked_fill(done, eos_token_id)
        out_tokens[:, step] = token
        done |= token == eos_token_id
        if done.all():
            break
        input_ids = token[:, None]
        mask = torch.cat([mask, torch.ones_like(input_ids)], dim=-1)
        positions = positions[:, -1:] + 1
    responses = []
    for seq in out_tokens[:, : step + 1].tolist():
        responses.append(seq[: seq.index(eos_token_id) + 1] if eos_token_id in seq else seq)
    return responses


def sample_responses(model, prompts: list[Prompt], *, n: int, eos_token_id: int, temperature: float = 1.0,
                     max_new_tokens: int = 512, prompts_per_batch: int = 32, seed: int = 0
                     ) -> list[list[list[int]]]:
    """``n`` sampled responses (token ids, through the EOS) per prompt.

    Static batches run until their longest row ends, so prompts go in order of
    expected response length: ``extra_info["num_steps"]`` where the task
    provides it (the built-in one does), else the prompt length.
    """
    if temperature <= 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    torch.manual_seed(seed)
    order = sorted(range(len(prompts)),
                   key=lambda i: prompts[i].extra_info.get("num_steps", len(prompts[i].input_ids)))
    out: list[list[list[int]]] = [[] for _ in prompts]
    for start in range(0, len(order), prompts_per_batch):
        batch = order[start : start + prompts_per_batch]
        rows = [prompts[i].input_ids for i in batch for _ in range(n)]
        with torch.no_grad():
            responses = _sample_batch(model, rows, eos_token_id=eos_token_id, temperature=temperature,
                                      max_new_tokens=max_new_tokens)
        for row, response in enumerate(responses):
            out[batch[row // n]].append(response)
    return out


def evaluate_policy(policy_dir: str, data_file: str, *, n: int = 8, seed: int = 0, threads: int = 2,
                    max_new_tokens: int = 512, max_prompt_length: int = 128, max_prompts: int | None = None
                    ) -> tuple[PolicyReport, list[list[int]]]:
    """Sample the policy on ``data_file`` (its first ``max_prompts`` prompts) and score it; also
    returns the per-prompt lengths."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    dataset = PromptDataset([data_file], tokenizer, max_prompt_length=max_prompt_length, shuffle=False)
    prompts = dataset.take(min(len(dataset), max_prompts or len(dataset)))
    responses = sample_responses(model, prompts, n=n, eos_token_id=tokenizer.eos_token_id,
                                 max_new_tokens=max_new_tokens, seed=seed)
    lengths = [[len(r) for r in rs] for rs in responses]
    correct = [[score_response(tokenizer.decode(r, skip_special_tokens=True), str(p.ground_truth))[0]
                for r in rs] for p, rs in zip(prompts, responses)]
    return report_from_lengths(lengths, correct), lengths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="assets/policy")
    parser.add_argument("--data", default="assets/data/eval.jsonl")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=512, help="the run's rollout.max_response_length")
    parser.add_argument("--json", help="also write the figures and the settings here")
    args = parser.parse_args(argv)
    report, _ = evaluate_policy(args.policy, args.data, n=args.n, seed=args.seed, threads=args.threads,
                                max_new_tokens=args.max_new_tokens)
    print(report.summary())
    print(asdict(report))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        command = shlex.join(["python", "-m", "rollpacker.examples.policy_report", *(argv or sys.argv[1:])])
        Path(args.json).write_text(json.dumps({"command": command, "settings": settings, "torch": torch.__version__,
                                               **asdict(report)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
