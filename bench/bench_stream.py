"""Stream trainer vs train-after-rollout, in one long round, one run (2 CPU ranks, gloo).

    python bench/bench_stream.py [--prompts 16] [--responses 4] [--repeats 2] [--model DIR]

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

The long round's lengths come from the built-in task's long tail: each prompt
draws a step count from the upper half of the task's log-normal, and its R0
responses run for 7 tokens a step (+ jitter), forced with ``max_new_tokens``
and no stop token, because the shipped policy is not in this checkout yet.
The default model is a random Qwen2 with the shipped policy's shape; rewards
are seeded coin flips (they do not change the compute). Completed groups go
from rank 0 to rank 1 through a TCPStore.
"""
from __future__ import annotations

import argparse
import os
import pickle
import random
import sys
import tempfile
import time
from pathlib import Path

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


def long_round(num_prompts: int, responses: int, seed: int) -> list[tuple[Prompt, list[int]]]:
    """Prompts of a long round with the response length of each of their responses."""
    rng = random.Random(seed)
    round_ = []
    for uid in range(num_prompts):
        steps = 0
        while steps < task.MEDIAN_STEPS:  # a long round holds the prompts that lost the short-round race
            steps = task.sample_num_steps(rng)
        prompt = Prompt(uid=uid, input_ids=[rng.randrange(3, 250) for _ in range(rng.randint(20, 40))],
                        data_source="bench")
        round_.append((prompt, [7 * steps + 6 + rng.randint(0, 6) for _ in range(responses)]))
    return round_


def rollout(engine, round_, store, mode: str, seed: int) -> list[list[Sample]]:
    """Run the round on ``engine``; publish each prompt group the moment its last response finishes."""
    prompts = {p.uid: (p, lengths) for p, lengths in round_}
    engine.submit([GenerationRequest(f"p{p.uid}r{i}", p.input_ids,
                                     SamplingParams(max_new_tokens=n, seed=seed * 7919 + p.uid * 31 + i))
                   for p, lengths in round_ for i, n in enumerate(lengths)])
    pending = {uid: {} for uid in prompts}
    groups, done = [], 0
    while len(groups) < len(prompts):
        for c in engine.poll(timeout=0.05):
            uid, index = (int(x) for x in c.request_id[1:].split("r"))
            reward = float(random.Random(seed * 1_000_003 + uid * 101 + index).random() < 0.5)
            pending[uid][index] = Sample(prompt=prompts[uid][0], response_index=index, response_ids=c.output_ids,
                                         rollout_logprobs=c.logprobs, finish_reason=c.finish_reason, reward=reward)
            done += 1
            store.set(f"{mode}/requests_done", str(done))
            if len(pending[uid]) == len(prompts[uid][1]):
                group = [pending[uid][i] for i in sorted(pending[uid])]
                store.set(f"{mode}/g{len(groups)}", pickle.dumps(group))
                groups.append(group)
                store.set(f"{mode}/groups", str(len(groups)))
    return groups


def stream_consumer(trainer, store, mode: str, total_requests: int, trigger: float | None) -> int:
    """Rank 1 while rollout runs: consume published groups once ``trigger`` of the requests are done."""
    consumed = 0
    while not store.check([f"{mode}/end"]):
        done = int(store.get(f"{mode}/requests_done")) if store.check([f"{mode}/requests_done"]) else 0
        published = int(store.get(f"{mode}/groups")) if store.check([f"{mode}/groups"]) else 0
        if trigger is not None and done >= trigger * total_requests and published > consumed:
            trainer.stream.consume([pickle.loads(store.get(f"{mode}/g{i}")) for i in range(consumed, published)])
            consumed = published
        else:
            time.sleep(0.002)
    trainer.stream.end_rollout()
    return consumed


def one_step(trainer, engine, store, round_, mode: str, args) -> dict:
    rank = dist.get_rank()
    total_requests = sum(len(lengths) for _, lengths in round_)
    dist.barrier()
    t0 = time.perf_counter()
    trainer.stream.begin()
    rollout_s = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        groups = rollout(engine, round_, store, mode, args.seed)
        rollout_s[0] = time.perf_counter() - t0
        trainer.stream.end_rollout()
        store.set(f"{mode}/end", "1")
        store.wait([f"{mode}/consumed"])
        consumed = int(store.get(f"{mode}/consumed"))
    else:
        consumed = stream_consumer(trainer, store, mode, total_requests,
                                   trainer.cfg.stream_trigger_low if mode.startswith("stream") else None)
        store.set(f"{mode}/consumed", str(consumed))
        groups = [pickle.loads(store.get(f"{mode}/g{i}")) for i in range(len(round_))]
    metrics = trainer.finish_step(groups[consumed:])
    step_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
    dist.all_reduce(rollout_s, op=dist.ReduceOp.MAX)
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    return {"step_s": float(step_s), "rollout_s": float(rollout_s), "metrics": metrics, "params": params}


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
    round_ = long_round(args.prompts, args.responses, args.seed)
    rows = []
    for rep in range(args.repeats):
        results = {}
        for mode in ("after", "stream"):
            trainer.load_state_dict(snapshot)
            results[mode] = one_step(trainer, engine, store, round_, f"{mode}{rep}", args)
        a, s = results["after"], results["stream"]
        rows.append((a, s, float((a["params"] - s["params"]).norm() / a["params"].norm())))
    if rank == 0:
        print(f"long round: {args.prompts} prompts x {args.responses} responses, "
              f"{sum(sum(lengths) for _, lengths in round_)} response tokens, "
              f"longest {max(max(lengths) for _, lengths in round_)}, model {args.model}")
        print("repeat  rollout_s(after/stream)  after_step_s  stream_step_s  ratio(after/stream)  overlap_share  "
              "groups_before_end  weight_rel_diff")
        for rep, (a, s, diff) in enumerate(rows):
            m = s["metrics"]
            print(f"{rep:>6}  {a['rollout_s']:11.2f}/{s['rollout_s']:<11.2f}  {a['step_s']:12.2f}  {s['step_s']:13.2f}  "
                  f"{a['step_s'] / s['step_s']:19.3f}  {m['stream_overlap_share']:13.3f}  "
                  f"{m['stream_groups_before_rollout_end']:>17}  {diff:15.2e}")
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(f"mean step-time ratio after/stream: {mean([a['step_s'] / s['step_s'] for a, s, _ in rows]):.3f}; "
              f"mean share of training compute before rollout end: "
              f"{mean([s['metrics']['stream_overlap_share'] for _, s, _ in rows]):.3f}")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF Qwen2 dir (default: random, the policy's shape)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_random_qwen2(Path(tmp) / "model", seed=args.seed, **POLICY_SHAPE))
        argv = [str(Path(__file__).resolve()), "--prompts", str(args.prompts), "--responses", str(args.responses),
                "--repeats", str(args.repeats), "--seed", str(args.seed), "--model", model]
        proc = run_torchrun(2, argv, timeout=1800)
        print(proc.stdout, end="")


if __name__ == "__main__":
    main()
