"""Stream trainer vs train-after-rollout, in one long round, one run (2 CPU ranks, gloo).

    python bench/bench_stream.py --policy [--prompts 16] [--responses 4] [--repeats 2]
    python bench/bench_stream.py             # no policy needed: synthetic lengths, random model

Rank 0 runs the reference rollout engine on a long round of P0 x R0 requests;
rank 1 is a rank handed over to training (DESIGN.md §4). Both are the two
data-parallel replicas of the trainer. Each repeat runs the same round twice,
from the same weights and with the same seeded sampling:

* after  - rank 1 idles until rollout ends, then both ranks train the whole batch
           (``train_step``): what a synchronous system does;
* stream - once ``trainer.stream_trigger_low`` of the requests are done, rank 1
           consumes finished prompt groups as they arrive (``stream.consume``),
           gradients local; at rollout end both ranks ``finish`` the rest.

Printed: rollout seconds, step seconds (round start -> optimizer step done)
for both modes and their ratio, the share of training compute (tokens) done
before rollout ended, and the relative difference of the weights after the
two steps (the stream step must be the same update).

``--policy``: the shipped policy (assets/policy) samples the long round's
longest-chain training prompts until EOS, scored by the task's checker.
Without it: a random Qwen2 of the policy's shape, response lengths forced
from the task's long tail (see ``synthetic_round``), coin-flip rewards.
Completed groups go from rank 0 to rank 1 through a TCPStore.

What this does not model: rank 1 holds no engine in either mode, so there is
no request migration at the hand-off (DESIGN.md: a few seconds of recompute)
and the baseline does not use rank 1 for rollout either. On this CPU machine
the engine and the streaming trainer share cores (on GPUs they are separate
devices), which slows the stream mode's rollout; hence the post-rollout
training time is printed next to the wall-clock step times.
"""
from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rollpacker.examples import task  # noqa: E402
from rollpacker.rollout.config import RolloutConfig  # noqa: E402
from rollpacker.rollout.engine import GenerationRequest, SamplingParams  # noqa: E402
from rollpacker.sample import Prompt, Sample  # noqa: E402
from rollpacker.testing import make_random_qwen2, run_torchrun  # noqa: E402

POLICY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=250, max_position_embeddings=1024)


@dataclass
class LongRound:
    """A long round: prompts, each response's token limit, the stop tokens and the reward rule."""

    prompts: list[Prompt]
    limits: list[list[int]]  # max_new_tokens of each response of each prompt
    stop_token_ids: tuple[int, ...]
    score: Callable[[Sample], float]

    @property
    def num_requests(self) -> int:
        return sum(len(x) for x in self.limits)


def synthetic_round(num_prompts: int, responses: int, seed: int) -> LongRound:
    """The built-in task's long tail with forced lengths: each prompt draws a step count from the upper
    half of the task's log-normal (a long round holds the prompts that lost the short-round race), and
    its responses run 7 tokens a step (+ jitter), with no stop token. Rewards: seeded coin flips."""
    rng = random.Random(seed)
    prompts, limits = [], []
    for uid in range(num_prompts):
        steps = 0
        while steps < task.MEDIAN_STEPS:
            steps = task.sample_num_steps(rng)
        prompts.append(Prompt(uid=uid, input_ids=[rng.randrange(3, 250) for _ in range(rng.randint(20, 40))],
                              data_source="bench"))
        limits.append([7 * steps + 6 + rng.randint(0, 6) for _ in range(responses)])
    return LongRound(prompts, limits, (), lambda s: float(
        random.Random(seed * 1_000_003 + s.prompt.uid * 101 + s.response_index).random() < 0.5))


def policy_round(policy: Path, num_prompts: int, responses: int, seed: int) -> LongRound:
    """The shipped policy on the task's training prompts: the longest-chain prompts of a random pool
    (a long round's), sampled until EOS or 512 tokens, scored by the task's checker."""
    from transformers import AutoTokenizer

    from rollpacker.data.dataset import PromptDataset

    tok = AutoTokenizer.from_pretrained(policy)
    data = PromptDataset([str(REPO / "assets" / "data" / "train.jsonl")], tok, max_prompt_length=256, seed=seed)
    pool = data.take(8 * num_prompts)
    prompts = sorted(pool, key=lambda p: -p.extra_info["num_steps"])[:num_prompts]

    def score(s: Sample) -> float:
        return float(task.score_response(tok.decode(s.response_ids, skip_special_tokens=True),
                                         s.prompt.ground_truth)[0])
    return LongRound(prompts, [[512] * responses for _ in prompts], (tok.eos_token_id,), score)


def rollout(engine, round_: LongRound, store, mode: str, seed: int) -> list[list[Sample]]:
    """Run the round on ``engine``; publish each prompt group the moment its last response finishes."""
    by_uid = {p.uid: (p, limits) for p, limits in zip(round_.prompts, round_.limits)}
    engine.submit([GenerationRequest(f"p{p.uid}r{i}", p.input_ids,
                                     SamplingParams(max_new_tokens=n, seed=seed * 7919 + p.uid * 31 + i,
                                                    stop_token_ids=round_.stop_token_ids))
                   for p, limits in zip(round_.prompts, round_.limits) for i, n in enumerate(limits)])
    pending = {uid: {} for uid in by_uid}
    groups, done = [], 0
    while len(groups) < len(by_uid):
        for c in engine.poll(timeout=0.05):
            uid, index = (int(x) for x in c.request_id[1:].split("r"))
            sample = Sample(prompt=by_uid[uid][0], response_index=index, response_ids=c.output_ids,
                            rollout_logprobs=c.logprobs, finish_reason=c.finish_reason)
            sample.reward = round_.score(sample)
            pending[uid][index] = sample
            done += 1
            if len(pending[uid]) == len(by_uid[uid][1]):
                group = [pending[uid][i] for i in sorted(pending[uid])]
                store.set(f"{mode}/g{len(groups)}", pickle.dumps(group))
                groups.append(group)
            # one key, so the consumer sees counts and the end flag together: the group that
            # ends the round is published with end=1 and is never streamed
            store.set(f"{mode}/state", f"{done} {len(groups)} {int(len(groups) == len(by_uid))}")
    return groups


def stream_consumer(trainer, store, mode: str, total_requests: int, trigger: float | None) -> int:
    """Rank 1 while rollout runs: consume published groups once ``trigger`` of the requests are done."""
    consumed = 0
    while True:
        done, published, ended = (int(x) for x in store.get(f"{mode}/state").split())
        if ended:
            break
        if trigger is not None and done >= trigger * total_requests and published > consumed:
            trainer.stream.consume([pickle.loads(store.get(f"{mode}/g{i}")) for i in range(consumed, published)])
            consumed = published
        else:
            time.sleep(0.005)
    trainer.stream.end_rollout()
    return consumed


def one_step(trainer, engine, store, round_: LongRound, mode: str, args) -> dict:
    rank = dist.get_rank()
    total_requests = round_.num_requests
    if rank == 0:
        store.set(f"{mode}/state", "0 0 0")
    dist.barrier()
    t0 = time.perf_counter()
    trainer.stream.begin()
    rollout_s = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        groups = rollout(engine, round_, store, mode, args.seed)
        rollout_s[0] = time.perf_counter() - t0
        trainer.stream.end_rollout()
        store.wait([f"{mode}/consumed"])
        consumed = int(store.get(f"{mode}/consumed"))
    else:
        consumed = stream_consumer(trainer, store, mode, total_requests,
                                   trainer.cfg.stream_trigger_low if mode.startswith("stream") else None)
        store.set(f"{mode}/consumed", str(consumed))
        groups = [pickle.loads(store.get(f"{mode}/g{i}")) for i in range(len(round_.prompts))]
    metrics = trainer.finish_step(groups[consumed:])
    step_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    dist.all_reduce(rollout_s, op=dist.ReduceOp.MAX)
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    return {"step_s": float(step_s), "rollout_s": float(rollout_s), "metrics": metrics, "params": params,
            "samples": [s for g in groups for s in g]}


def worker(args) -> None:
    from megatron_ext.parallel import setup_layout
    from rollpacker.rollout.reference import ReferenceEngine
    from rollpacker.trainer.config import TrainerConfig
    from rollpacker.trainer.trainer import Trainer

    torch.set_num_threads(1)
    layout = setup_layout(1, 1, 1)
    rank = dist.get_rank()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, 2, rank == 0)
    cfg = TrainerConfig(lr=1e-4, params_dtype="fp32", micro_batch_tokens=2048, stream_trigger_low=0.2)
    trainer = Trainer(cfg, args.model, layout)
    snapshot = trainer.state_dict()
    engine = None
    if rank == 0:
        engine = ReferenceEngine(args.model, RolloutConfig(max_response_length=1024, kv_cache_tokens=1 << 16,
                                                           max_running_requests=1024))
    load = os.getloadavg()
    round_ = (policy_round(Path(args.model), args.prompts, args.responses, args.seed) if args.policy
              else synthetic_round(args.prompts, args.responses, args.seed))
    rows = []
    for rep in range(args.repeats):
        results = {}
        for mode in ("after", "stream"):
            trainer.load_state_dict(snapshot)
            results[mode] = one_step(trainer, engine, store, round_, f"{mode}{rep}", args)
        a, s = results["after"], results["stream"]
        rows.append((a, s, float((a["params"] - s["params"]).norm() / a["params"].norm())))
    if rank == 0:
        lengths = [len(s.response_ids) for s in rows[0][1]["samples"]]
        print(f"long round ({'shipped policy' if args.policy else 'synthetic lengths'}): {args.prompts} prompts x "
              f"{args.responses} responses, {sum(lengths)} response tokens, median "
              f"{sorted(lengths)[len(lengths) // 2]}, longest {max(lengths)}, model {args.model}")
        print(f"load average before the run (other jobs share these 2 cores): {load[0]:.1f}; "
              f"after: {os.getloadavg()[0]:.1f}")
        print("repeat  rollout_s(after/stream)  train_after_rollout_s(after/stream)  after_step_s  stream_step_s  "
              "ratio(after/stream)  overlap_share  groups_before_end  weight_rel_diff")
        for rep, (a, s, diff) in enumerate(rows):
            m = s["metrics"]
            tail_a, tail_s = a["step_s"] - a["rollout_s"], s["step_s"] - s["rollout_s"]
            print(f"{rep:>6}  {a['rollout_s']:11.2f}/{s['rollout_s']:<11.2f}  {tail_a:17.2f}/{tail_s:<17.2f}  "
                  f"{a['step_s']:12.2f}  {s['step_s']:13.2f}  "
                  f"{a['step_s'] / s['step_s']:19.3f}  {m['stream_overlap_share']:13.3f}  "
                  f"{m['stream_groups_before_rollout_end']:>17}  {diff:15.2e}")
        ratios = sorted(a["step_s"] / s["step_s"] for a, s, _ in rows)
        shares = sorted(s["metrics"]["stream_overlap_share"] for _, s, _ in rows)
        tails = [(a["step_s"] - a["rollout_s"], s["step_s"] - s["rollout_s"]) for a, s, _ in rows]
        print(f"median step-time ratio after/stream: {statistics.median(ratios):.3f}; median share of training "
              f"compute before rollout end: {statistics.median(shares):.3f}; median training after rollout end: "
              f"{statistics.median(t[0] for t in tails):.2f} s -> {statistics.median(t[1] for t in tails):.2f} s")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF Qwen2 dir (default: random, the policy's shape)")
    parser.add_argument("--policy", action="store_true",
                        help="sample a real long round from --model (the shipped policy and its task)")
    args = parser.parse_args()
    if args.policy and args.model is None:
        args.model = str(REPO / "assets" / "policy")
    if "RANK" in os.environ:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_random_qwen2(Path(tmp) / "model", seed=args.seed, **POLICY_SHAPE))
        argv = [str(Path(__file__).resolve()), "--prompts", str(args.prompts), "--responses", str(args.responses),
                "--repeats", str(args.repeats), "--seed", str(args.seed), "--model", model,
                *(["--policy"] if args.policy else [])]
        proc = run_torchrun(2, argv, timeout=1800)
        print(proc.stdout, end="")


if __name__ == "__main__":
    main()
