"""The single-node peer RollPacker is compared with: TRL's ``GRPOTrainer`` on CPU, same GRPO recipe.

Measures, per optimizer step of P0 prompts x R0 completions: wall seconds, the seconds spent
inside TRL's generation (``_generate_single_turn``: left-padding plus ``model.generate``), and the
mean reward / accuracy of the step's completions, scored by RollPacker's own stepchain scorer.

Same inputs as RollPacker: the HF policy directory, the prompts in the order ``PromptDataset``
serves them (seeded by ``data.seed``, default 1; the first ``steps*P0`` of that order, which is
exactly what ``scheduler.mode=baseline`` trains), token-identical chat-templated prompts (checked),
and the GRPO settings of ``rollpacker/trainer/config.py`` (see ``trl_settings``). Not matched:
TRL divides advantages by ``std + 1e-4`` (RollPacker: ``adv_eps`` 1e-6); TRL samples with static-batch
``generate`` (a step waits for its longest completion), which is the behaviour being compared; and
under tail batching RollPacker trains a different subset of the same prompt stream.

Needs TRL, which CI does not install::

    pip install -r requirements-bench.txt     # trl 1.16; keeps torch 2.13.0 (CPU) and transformers 5.x
    python bench/e2e/trl_grpo.py --policy assets/policy --data assets/data/train.jsonl --steps 3 \\
        --p0 16 --r0 4 --max-response-length 512 --lr 2e-4 --seed 0 --threads 2 --json out.json

Writes ``--json``: trl_version, steps, p0, r0, seconds_per_step, generation_seconds, lr, reward_mean,
accuracy, prompts_trained (one entry per step) and settings (every TRL argument set here).
``--save DIR`` keeps the trained policy for an offline evaluation (``bench/e2e/example_trl.py`` runs the
program's own held-out eval on it).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

# Run as a script (``python bench/e2e/trl_grpo.py``), sys.path[0] is bench/e2e/: make ``rollpacker`` importable.
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

INSTALL_HINT = "pip install -r requirements-bench.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="TRL GRPOTrainer on CPU with RollPacker's GRPO settings: seconds/step, generation "
                    f"share, reward. Needs TRL: {INSTALL_HINT}")
    p.add_argument("--policy", default="assets/policy", help="HF model directory (with tokenizer)")
    p.add_argument("--data", default="assets/data/train.jsonl", help="verl-style JSONL prompt file")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--p0", type=int, default=16, help="prompts per step")
    p.add_argument("--r0", type=int, default=4, help="responses per prompt (num_generations, >= 2)")
    p.add_argument("--max-response-length", type=int, default=512, help="max_completion_length")
    p.add_argument("--max-prompt-length", type=int, default=1024,
                   help="prompts longer than this are skipped, as data.max_prompt_length does")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lr-warmup-steps", type=int, default=0,
                   help="linear warm-up as trainer.lr_warmup_steps: step k (from 1) at lr * min(1, k / N)")
    p.add_argument("--seed", type=int, default=0, help="GRPOConfig.seed: seeds torch, hence sampling")
    p.add_argument("--data-seed", type=int, default=1,
                   help="prompt order seed; RollPacker's data.seed (default 1) for the same order")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    p.add_argument("--save", default=None,
                   help="save the trained policy here (weights, and the tokenizer files of --policy) "
                        "for an offline evaluation")
    args = p.parse_args(argv)
    if args.steps < 1 or args.p0 < 1 or args.r0 < 2 or args.threads < 1 or args.lr_warmup_steps < 0:
        p.error("need --steps >= 1, --p0 >= 1, --r0 >= 2 (GRPO needs a group), --threads >= 1 "
                "and --lr-warmup-steps >= 0")
    return args


def _read_messages(path: Path, uids: set[int]) -> dict[int, Any]:
    """The raw ``prompt`` field of the rows with these uids (uid = index over non-blank lines)."""
    if path.suffix != ".jsonl":
        raise SystemExit(f"{path}: this runner reads .jsonl prompt files only")
    found: dict[int, Any] = {}
    with path.open("rb") as f:
        uid = 0
        for raw in f:
            if not raw.strip():
                continue  # PromptDataset does not number blank lines either
            if uid in uids:
                found[uid] = json.loads(raw)["prompt"]
            uid += 1
    return found


def load_prompts(tokenizer: Any, data: Path, n: int, data_seed: int, max_prompt_length: int) -> list[dict]:
    """The first ``n`` prompts in RollPacker's serving order, as TRL dataset rows."""
    from rollpacker.data.dataset import PromptDataset

    dataset = PromptDataset([str(data)], tokenizer, max_prompt_length=max_prompt_length, seed=data_seed)
    prompts = dataset.take(n)
    raw = _read_messages(data, {p.uid for p in prompts})
    rows = []
    for p in prompts:
        messages = raw[p.uid]
        if isinstance(messages, str):  # plain-text rows: the template is applied to one user turn
            messages = [{"role": "user", "content": messages}]
        # TRL tokenizes conversational prompts itself; refuse to run if it would not see the same tokens.
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        if list(ids) != list(p.input_ids):
            raise SystemExit(f"prompt uid {p.uid}: TRL's tokenization differs from RollPacker's")
        rows.append({"prompt": messages, "ground_truth": str(p.ground_truth),
                     "data_source": p.data_source, "uid": p.uid})
    return rows


def make_reward(log: list[tuple[float, float]]) -> Callable[..., list[float]]:
    """A TRL reward function around RollPacker's scorer; appends (mean reward, accuracy) per call."""
    from rollpacker.reward.scorers import STEPCHAIN, scorer_for
    from rollpacker.reward.scorers.stepchain import score_stepchain

    def stepchain_reward(prompts: list, completions: list, ground_truth: list[str],
                         data_source: list[str], **_: Any) -> list[float]:
        rewards, correct = [], []
        for completion, truth, source in zip(completions, ground_truth, data_source, strict=True):
            if scorer_for(source) != STEPCHAIN:
                raise ValueError(f"data_source {source!r}: this runner scores stepchain rows only")
            # Conversational prompts come back as [{"role": "assistant", "content": text}]; TRL decoded
            # with skip_special_tokens=True, as RollPacker's reward sink does.
            text = completion if isinstance(completion, str) else completion[-1]["content"]
            score = score_stepchain(text, truth)
            rewards.append(score.reward)
            correct.append(float(score.correct))
        log.append((sum(rewards) / len(rewards), sum(correct) / len(correct)))
        return rewards

    return stepchain_reward


def trl_settings(args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    """Every GRPOConfig argument set here, explicitly: TRL's defaults differ from RollPacker's."""
    return dict(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, seed=args.seed,
        max_steps=args.steps, report_to="none", save_strategy="no",
        logging_strategy="no",  # keep stdout to our summary; the numbers come from the callbacks
        disable_tqdm=True, log_level="warning", dataloader_num_workers=0,
        # One optimizer step = P0 prompts x R0 completions, generated once and trained on once.
        per_device_train_batch_size=args.p0 * args.r0, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=args.r0, num_iterations=1,
        shuffle_dataset=False,  # the rows are already in RollPacker's order
        # Optimizer: trainer.{lr, adam_beta1/2, adam_eps, weight_decay, grad_clip}; the schedule is
        # passed as a LambdaLR (see run): HF's constant_with_warmup runs step 1 at lr 0, ours at lr / N.
        optim="adamw_torch", learning_rate=args.lr, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        # Both names: transformers 5 renamed it, and TRL's default for the old name is True.
        activation_checkpointing=False, gradient_checkpointing=False,
        # Loss: trainer.kl_coef=0, clip_low/high=0.2/0.28, token_mean over the whole step ("dapo" divides
        # by the active tokens of the global batch), group std normalisation, per-token ratios.
        beta=0.0, epsilon=0.2, epsilon_high=0.28, delta=None, loss_type="dapo",
        scale_rewards="group", importance_sampling_level="token", mask_truncated_completions=False,
        top_entropy_quantile=1.0, entropy_coef=0.0, off_policy_mask_threshold=None,
        disable_dropout=True, cast_lm_head_to_fp32=False,
        # Sampling: rollout.{temperature, max_response_length}, no top-p/top-k/min-p/penalty.
        max_completion_length=args.max_response_length, temperature=args.temperature,
        top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        use_vllm=False, use_transformers_continuous_batching=False, pad_to_multiple_of=None,
        log_completions=False, remove_unused_columns=False,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rollpacker.trainer.config import TrainerConfig

    try:
        import torch
        import transformers
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise SystemExit(f"bench/e2e/trl_grpo.py needs TRL and its dependencies ({exc}); {INSTALL_HINT}") from None

    # TRL 1.16 calls a transformers 5 alias that warns on every run; nothing for a user to act on.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    torch.set_num_threads(args.threads)  # as run.threads_per_rank does, before any work
    transformers.utils.logging.disable_progress_bar()  # a caller parses nothing but --json; keep logs short
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    rows = load_prompts(tokenizer, Path(args.data), args.steps * args.p0, args.data_seed,
                        args.max_prompt_length)
    model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32)  # fp32, as params_dtype

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step; generation time is added by the wrapper below."""

        def __init__(self) -> None:
            self.start, self.generation = 0.0, 0.0
            self.seconds: list[float] = []
            self.generation_seconds: list[float] = []
            self.lr: list[float] = []

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.generation = 0.0
            self.lr.append(optimizer.param_groups[0]["lr"])
            self.start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.seconds.append(time.perf_counter() - self.start)
            self.generation_seconds.append(self.generation)

    schedule = TrainerConfig(lr=args.lr, lr_warmup_steps=args.lr_warmup_steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0)
    # LambdaLR's counter is 0 at the first optimizer step; trainer.lr_at counts steps from 1.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: schedule.lr_at(k + 1) / args.lr)
    rewards: list[tuple[float, float]] = []
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="trl_grpo_") as output_dir:
        settings = trl_settings(args, output_dir)
        trainer = GRPOTrainer(model=model, reward_funcs=make_reward(rewards),
                              args=GRPOConfig(**settings), train_dataset=Dataset.from_list(rows),
                              processing_class=tokenizer, callbacks=[timer], optimizers=(optimizer, scheduler))
        trainer.remove_callback(PrinterCallback)  # its end-of-training dict would bury the summary
        # Generation happens inside training_step (GRPOTrainer._prepare_inputs), i.e. between
        # on_step_begin and on_step_end. Time TRL's sampling method itself, on this instance only.
        if not hasattr(trainer, "_generate_single_turn"):
            raise SystemExit(f"trl {trl.__version__}: GRPOTrainer has no _generate_single_turn to time; "
                             f"{INSTALL_HINT}")
        generate = trainer._generate_single_turn

        def timed_generate(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return generate(*a, **k)
            finally:
                timer.generation += time.perf_counter() - start

        trainer._generate_single_turn = timed_generate
        trainer.train()
        if args.save:
            save_policy(trainer.model, Path(args.policy), Path(args.save))

    if not (len(timer.seconds) == len(rewards) == args.steps):
        raise RuntimeError(f"expected {args.steps} steps, timed {len(timer.seconds)}, scored {len(rewards)}")
    settings["output_dir"] = None  # a deleted temporary directory
    settings.update(lr_warmup_steps=args.lr_warmup_steps, saved_to=args.save, model_dtype="float32",
                    torch_threads=args.threads, data_seed=args.data_seed,
                    max_prompt_length=args.max_prompt_length, reward="rollpacker stepchain scorer",
                    loss_note="dapo: token-level loss summed and divided by the step's active tokens "
                              "(RollPacker token_mean)", advantage_std_eps=1e-4)
    return {
        "trl_version": trl.__version__, "steps": args.steps, "p0": args.p0, "r0": args.r0,
        "seconds_per_step": timer.seconds, "generation_seconds": timer.generation_seconds, "lr": timer.lr,
        "reward_mean": [r for r, _ in rewards], "accuracy": [a for _, a in rewards],
        "prompts_trained": [args.p0 * (i + 1) for i in range(args.steps)], "settings": settings,
    }


def save_policy(model: Any, policy: Path, out: Path) -> None:
    """The trained weights with the tokenizer and generation files of the starting policy, so the
    directory loads wherever ``policy`` does (``model.path``, ``rollpacker-generate``)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                 "merges.txt", "generation_config.json"):
        if (policy / name).is_file():
            shutil.copy2(policy / name, out / name)


def summary(result: dict[str, Any]) -> str:
    secs, gen = result["seconds_per_step"], result["generation_seconds"]
    lines = [f"TRL {result['trl_version']} GRPOTrainer, CPU: {result['steps']} steps of "
             f"{result['p0']} prompts x {result['r0']} completions",
             f"  seconds/step: mean {sum(secs) / len(secs):.2f} (min {min(secs):.2f}, max {max(secs):.2f}); "
             f"generation share {sum(gen) / sum(secs):.0%}",
             "  reward per step: " + " ".join(f"{r:.3f}" for r in result["reward_mean"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
