"""Make the shipped starting policy and data of the built-in example.

    python -m rollpacker.examples.make_policy [--recipe shipped|recheck|single] [--out DIR] [--data-out DIR]

Writes the tokenizer, a small Qwen2ForCausalLM after a supervised warm-up on
stepchain derivations, and the train/eval prompt files.  The demonstrations
carry a per-step error rate and, in the last stages, a share of final lines
that the task's strict checker rejects (``REJECTED_ANSWER_LINES``), so the
policy is imperfect in ways GRPO can fix from the reward: sampled chains make
mistakes, and over half the samples end in the wrong answer format.

By default (``--recipe shipped``) it makes the shipped ``assets/policy``: five
warm-up stages, each continuing the last (``SHIPPED_STAGES``; about 25 min of
one-thread CPU time in all; the last stage's ``warmup.json`` records its
settings). ``--recipe recheck`` continues ``assets/policy`` for one stage on
demonstrations that re-derive the problem before answering (``task.RECHECKS``)
and writes ``assets/policy-recheck`` and ``assets/data-recheck``: the task's
reasoning-shaped variant (about 6 min). ``--recipe single`` runs one stage with
the flags given, e.g. ``--init DIR`` to continue a warm-up.

Deterministic: every random draw comes from ``--seed`` (Python ``Random`` for
data, ``torch.manual_seed`` for weights), and torch runs with
``use_deterministic_algorithms`` on a fixed thread count (``--threads``,
default 1).  The same seed, thread count and torch build give bit-identical
weights; a different thread count may change float summation order.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from rollpacker.examples import task
from rollpacker.examples.tokenizer import IM_END, build_tokenizer, save_tokenizer, user_prompt

TRAIN_PROMPTS_SEED = 1001
EVAL_PROMPTS_SEED = 2002


@dataclass(frozen=True)
class WarmupConfig:
    seed: int = 0
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    steps: int = 500
    batch_tokens: int = 4096  # per optimizer step, prompt + response, padding included
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    step_error_rate: float = 0.05  # per-step corruption of the demonstrations
    uniform_fraction: float = 0.3  # share of examples with uniform (not log-normal) step counts
    # Share of demonstrations whose last line is an answer the strict checker rejects
    # (REJECTED_ANSWER_LINES): the format lesson GRPO has to learn from the reward alone.
    rejected_format_rate: float = 0.0
    # Shares of demonstrations that derive the problem again before answering (task.Rechecks).
    recheck_first: float = 0.0
    recheck_again: float = 0.0
    threads: int = 1
    init: str | None = None  # continue from this checkpoint instead of random weights


def _demonstration(rng: random.Random, cfg: WarmupConfig) -> task.Problem:
    # Half the demonstrations have uniform step counts: the log-normal task
    # distribution alone would show the model almost no 30..50-step chains.
    uniform = rng.random() < cfg.uniform_fraction
    return task.sample_problem(rng, rng.randint(1, task.MAX_STEPS) if uniform else None)


# Final lines a reader would accept and the task's checker does not (it wants exactly "Answer: N").
REJECTED_ANSWER_LINES = ("Result: {}", "So the value is {}", "= {}")


def _response(problem: task.Problem, rng: random.Random, cfg: WarmupConfig) -> str:
    text = task.derivation(problem, rng=rng, error_rate=cfg.step_error_rate,
                           rechecks=task.Rechecks(cfg.recheck_first, cfg.recheck_again))
    if cfg.rejected_format_rate > 0 and rng.random() < cfg.rejected_format_rate:
        body, _, answer = text.rpartition("\nAnswer: ")
        text = f"{body}\n{rng.choice(REJECTED_ANSWER_LINES).format(answer)}"
    return text


def _encode(tok, problem: task.Problem, response: str) -> tuple[list[int], int]:
    prompt_ids = tok.encode(user_prompt(problem.prompt_text())).ids
    response_ids = tok.encode(response + IM_END).ids
    return prompt_ids + response_ids, len(prompt_ids)


def _batches(cfg: WarmupConfig, tok, rng: random.Random):
    """Endless length-bucketed batches of (input_ids, labels) under a token budget."""
    pad = tok.token_to_id(IM_END)
    while True:
        pool = []
        for _ in range(512):
            problem = _demonstration(rng, cfg)
            pool.append(_encode(tok, problem, _response(problem, rng, cfg)))
        pool.sort(key=lambda item: len(item[0]))
        batches, current = [], []
        for item in pool:
            if current and (len(current) + 1) * len(item[0]) > cfg.batch_tokens:
                batches.append(current)
                current = []
            current.append(item)
        batches.append(current)
        rng.shuffle(batches)
        for batch in batches:
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            for row, (ids, prompt_len) in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
            yield input_ids, labels


def build_model(cfg: WarmupConfig, vocab_size: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).float()


def train(cfg: WarmupConfig, out: Path, log_every: int = 50) -> float:
    """Warm up a fresh policy and save it (weights + tokenizer) to ``out``; returns seconds taken."""
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tok = build_tokenizer()
    if cfg.init:
        from transformers import Qwen2ForCausalLM

        model = Qwen2ForCausalLM.from_pretrained(cfg.init, dtype=torch.float32)
    else:
        model = build_model(cfg, tok.get_vocab_size())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98),
                                  weight_decay=cfg.weight_decay)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    start = time.perf_counter()
    batches = _batches(cfg, tok, rng)
    for step in range(cfg.steps):
        input_ids, labels = next(batches)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % log_every == 0 or step == cfg.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}  "
                  f"{time.perf_counter() - start:7.1f}s", flush=True)
    seconds = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)
    (out / "warmup.json").write_text(json.dumps({**asdict(cfg), "train_seconds": round(seconds, 1),
                                                 "torch": torch.__version__}, indent=2) + "\n")
    return seconds


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


# The shipped policy's warm-up: a long stage at the default rate, two shorter ones at lower rates,
# then two on cleaner derivations of which 55% end in a rejected answer line. After them greedy
# decoding is right on nearly every held-out prompt, while at temperature 1 over half the responses
# end in a line the checker rejects: a lesson the reward alone teaches (docs/example.md).
SHIPPED_STAGES = (
    {"seed": 0, "steps": 500},
    {"seed": 1, "steps": 250, "lr": 1e-3, "warmup_steps": 10},
    {"seed": 2, "steps": 400, "lr": 1.5e-3, "warmup_steps": 10},
    {"seed": 3, "steps": 400, "lr": 1e-3, "warmup_steps": 10, "step_error_rate": 0.02, "rejected_format_rate": 0.55},
    {"seed": 4, "steps": 600, "lr": 1e-3, "warmup_steps": 10, "step_error_rate": 0.02, "rejected_format_rate": 0.55},
)


# The recheck variant's policy: the shipped one (--init) taught to re-derive before answering at
# task.RECHECKS' rates, on the same clean, format-lesson demonstrations as its last stage.
RECHECK_STAGES = (
    {"seed": 5, "steps": 500, "lr": 1e-3, "warmup_steps": 10, "step_error_rate": 0.02, "rejected_format_rate": 0.55,
     "recheck_first": task.RECHECKS.first, "recheck_again": task.RECHECKS.again},
)


@dataclass(frozen=True)
class Recipe:
    stages: tuple[dict, ...]
    policy_out: str
    data_out: str
    median_steps: float  # of the prompts written beside the policy
    init: str | None = None  # the policy the first stage continues (None: random weights)


RECIPES = {"shipped": Recipe(SHIPPED_STAGES, "assets/policy", "assets/data", task.MEDIAN_STEPS),
           "recheck": Recipe(RECHECK_STAGES, "assets/policy-recheck", "assets/data-recheck",
                             task.RECHECK_MEDIAN_STEPS, init="assets/policy")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=(*RECIPES, "single"), default="shipped",
                        help="shipped: the five stages that made assets/policy; recheck: the one stage that "
                             "makes assets/policy-recheck from --init (default assets/policy); single: one "
                             "stage from the flags")
    parser.add_argument("--out", help="policy directory (default: the recipe's; single: assets/policy)")
    parser.add_argument("--data-out", help="train/eval prompts directory (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=WarmupConfig.steps)
    parser.add_argument("--threads", type=int, default=WarmupConfig.threads)
    parser.add_argument("--lr", type=float, default=WarmupConfig.lr)
    parser.add_argument("--warmup-steps", type=int, default=WarmupConfig.warmup_steps)
    parser.add_argument("--init", default=None, help="continue the warm-up from this policy directory")
    parser.add_argument("--train-prompts", type=int, default=2048)
    parser.add_argument("--eval-prompts", type=int, default=256)
    args = parser.parse_args(argv)
    single = {"seed": args.seed, "steps": args.steps, "lr": args.lr, "warmup_steps": args.warmup_steps}
    recipe = RECIPES.get(args.recipe) or replace(RECIPES["shipped"], stages=(single,))
    policy_out, data_out = Path(args.out or recipe.policy_out), Path(args.data_out or recipe.data_out)
    init = args.init or recipe.init
    for name, n, seed in (("train", args.train_prompts, TRAIN_PROMPTS_SEED),
                          ("eval", args.eval_prompts, EVAL_PROMPTS_SEED)):
        write_jsonl(data_out / f"{name}.jsonl", task.generate_rows(n, seed, recipe.median_steps))
    seconds = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for i, stage in enumerate(recipe.stages):
            out = policy_out if i == len(recipe.stages) - 1 else Path(tmp) / f"stage{i}"
            seconds += train(WarmupConfig(threads=args.threads, init=init, **stage), out)
            init = str(out)
    print(f"policy written to {policy_out} after {seconds / 60:.1f} min of warm-up")


if __name__ == "__main__":
    main()
