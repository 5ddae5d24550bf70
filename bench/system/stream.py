"""The stream trainer against what a user without it does: rank 1 keeps generating (2 CPU ranks).

    python -m bench.system.stream --policy [--prompts 16] [--responses 4] [--repeats 3] [--out bench/results/stream.json]
    python -m bench.system.stream             # no policy needed: synthetic lengths, random model

One long round of P0 x R0 requests over two TP-1 reference engines, one per
rank, each rank also a data-parallel replica of the trainer. The round runs
through the program's own rollout phase (``RolloutPhase``: the scheduler's long
round on rank 0, rank 1's engine served over the coordinator channel) and
both modes end in the program's training step (``Trainer.finish_step`` on the
groups nobody streamed, in canonical order):

* baseline - no stream trainer: both engines generate until every request is
             done, then both ranks train the whole batch;
* stream   - ``trainer.stream``: once ``stream_trigger_low``-``high`` of the
             requests are done (the scheduler's ``HandoffTrigger``), rank 1's
             engine leaves the round, its unfinished requests migrate to rank 0
             with the tokens they generated (evict, resubmit; the KV cache is
             rebuilt by recompute) and rank 1 trains the finished groups rank 0
             feeds it (``StreamFeed`` / ``stream_train``) until rollout ends.

Each repeat runs both modes from the same weights and with the same request
seeds (a scheduler per mode, so a repeat's round has the same index in both,
and each repeat samples afresh); the order of the two alternates between repeats. A reference engine samples a
migrated request exactly as in place, so both modes train on the same samples
and must take the same update. Recorded per run: step seconds (round start ->
optimizer step done, slowest rank), rollout seconds, requests and tokens
migrated, the share of the requests done at the hand-off, the share of the
training compute (tokens) done before rollout ended (the trainer's
``stream_overlap_share``: training finished before the moment rank 0's rollout
ended, though the streaming rank learns of that moment later);
per repeat the relative difference of the two modes' weights.

``--policy``: the shipped policy (assets/policy) samples the longest-chain
training prompts of a random pool (a long round's) until EOS or 512 tokens,
scored by the task's checker. Without it: a random Qwen2 of the policy's
shape, each response's length forced from the task's long tail (see
``synthetic_round``), seeded coin-flip rewards. Rewards are scored in the
scheduler's thread (the program uses its reward pool; both scorers here take
microseconds).

Caveat, recorded with the results: on this 2-core CPU the two engines, the
trainer and the other jobs on the machine share the cores; on GPUs an engine
and the stream trainer each have their own device. Engines are awake the whole
run (no phase machine: the program's offload and weight sync cost the same in
both modes) and keep the initial weights, as every run restores them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.tools.report import stream  # noqa: E402
from bench.tools.results import write_results  # noqa: E402
from megatron_ext.parallel import setup_layout  # noqa: E402
from rollpacker.examples import task  # noqa: E402
from rollpacker.reward.score import WRONG_ANSWER, Score  # noqa: E402
from rollpacker.rollout.config import RolloutConfig  # noqa: E402
from rollpacker.rollout.engine import MEMORY_TAGS, GenerationRequest, RolloutEngine  # noqa: E402
from rollpacker.runtime.engines import EngineSets  # noqa: E402
from rollpacker.runtime.rollout_phase import RolloutPhase, broadcast_groups  # noqa: E402
from rollpacker.runtime.streaming import replica_of_ranks  # noqa: E402
from rollpacker.runtime.world import World  # noqa: E402
from rollpacker.sample import Prompt, Sample  # noqa: E402
from rollpacker.scheduler import Scheduler  # noqa: E402
from rollpacker.scheduler.config import PlannerConfig, SchedulerConfig  # noqa: E402
from rollpacker.scheduler.round import EngineLayout  # noqa: E402
from testkit import make_random_qwen2, run_torchrun  # noqa: E402
from rollpacker.trainer.config import TrainerConfig  # noqa: E402
from rollpacker.trainer.trainer import Trainer  # noqa: E402

POLICY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=250, max_position_embeddings=1024)
MODES = ("baseline", "stream")
CAVEAT = ("2 CPU cores shared by both rollout engines, the trainer and other jobs on the machine; on GPUs an "
          "engine and the stream trainer each have their own device")


@dataclass
class LongRound:
    """A long round: its prompts, the response length limit, the stop tokens and the reward rule."""

    prompts: list[Prompt]
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    score: Callable[[Sample], Score]
    lengths: dict[str, int] | None = None  # synthetic: each request's forced length, by request id


def synthetic_round(num_prompts: int, responses: int, seed: int) -> LongRound:
    """The built-in task's long tail with forced lengths: each prompt draws a step count from the upper
    half of the task's log-normal (a long round holds the prompts that lost the short-round race), and
    its responses run 7 tokens a step (+ jitter), with no stop token. Rewards: seeded coin flips."""
    rng = random.Random(seed)
    prompts, lengths = [], {}
    for uid in range(num_prompts):
        steps = 0
        while steps < task.MEDIAN_STEPS:
            steps = task.sample_num_steps(rng)
        prompt = Prompt(uid=uid, input_ids=[rng.randrange(3, 250) for _ in range(rng.randint(20, 40))],
                        data_source="bench")
        prompts.append(prompt)
        for i in range(responses):
            lengths[Sample(prompt=prompt, response_index=i).request_id] = 7 * steps + 6 + rng.randint(0, 6)

    def score(s: Sample) -> Score:
        coin = random.Random(seed * 1_000_003 + s.prompt.uid * 101 + s.response_index).random() < 0.5
        return Score.passed() if coin else Score.failed(WRONG_ANSWER)
    return LongRound(prompts, max(lengths.values()), (), score, lengths)


def policy_round(policy: Path, num_prompts: int, responses: int, seed: int) -> LongRound:
    """The shipped policy on the task's training prompts: the longest-chain prompts of a random pool
    (a long round's), sampled until EOS or 512 tokens, scored by the task's checker."""
    from transformers import AutoTokenizer

    from rollpacker.data.dataset import PromptDataset

    tok = AutoTokenizer.from_pretrained(policy)
    data = PromptDataset([str(REPO / "assets" / "data" / "train.jsonl")], tok, max_prompt_length=256, seed=seed)
    prompts = sorted(data.take(8 * num_prompts), key=lambda p: -p.extra_info["num_steps"])[:num_prompts]

    def score(s: Sample) -> Score:
        correct, reason = task.score_response(tok.decode(list(s.response_ids), skip_special_tokens=True),
                                              s.prompt.ground_truth)
        return Score(float(correct), correct, reason)
    return LongRound(prompts, 512, (tok.eos_token_id,), score)


class ForcedLengths:
    """A rollout engine whose every request stops at the synthetic round's length for it; migrated
    requests keep theirs, since the limit goes by request id. Everything else is the engine's."""

    def __init__(self, engine: RolloutEngine, lengths: dict[str, int]):
        self._engine, self._lengths = engine, lengths

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self._engine.submit([dataclasses.replace(r, params=dataclasses.replace(
            r.params, max_new_tokens=self._lengths[r.request_id])) for r in requests])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class InlineReward:
    """The scheduler's ``RewardSink``, scoring in its own thread."""

    def __init__(self, score: Callable[[Sample], Score]):
        self.score = score

    def submit(self, sample: Sample, *, key: str | None = None, adapt: bool = True) -> Future:
        future: Future = Future()
        future.set_result(self.score(sample))
        return future


def one_step(world: World, trainer: Trainer, phase: RolloutPhase, round_: LongRound, snapshot: dict) -> dict[str, Any]:
    """One long round and its optimizer step, as ``rollpacker.runtime.run.Run`` runs them; rank 0's record."""
    trainer.load_state_dict(snapshot)
    dist.barrier(group=world.control)
    t0 = time.perf_counter()
    plan = None
    if phase.scheduler is not None:
        phase.scheduler.queue.push(round_.prompts)  # P0 queued prompts: the scheduler plans a long round
        plan = phase.scheduler.plan_round()
    result, to_training = phase.run(plan)
    if to_training:
        phase.stream_train(trainer.stream)
    groups = broadcast_groups(phase.unstreamed(result), world.control)
    groups = sorted((sorted(g, key=lambda s: s.response_index) for g in groups),
                    key=lambda g: (g[0].prompt.epoch, g[0].prompt.uid))
    trainer.begin_step()
    metrics = trainer.finish_step(groups)
    step_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX, group=world.control)
    if result is None:
        return {}
    s = result.stats
    return {"step_s": float(step_s), "rollout_s": s.rollout_seconds, "generated_tokens": s.generated_tokens,
            "migrated_requests": s.migrated_requests, "migrated_tokens": s.migrated_tokens,
            "handoff_fraction": s.handoff_fraction, "streamed_groups": len(phase.streamed),
            "overlap_share": metrics["stream_overlap_share"],
            "lengths": [x.num_response_tokens for x in result.samples],
            "params": torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])}


def worker(args) -> None:
    world = World.init()
    world.build_rollout_layouts([1])
    round_ = (policy_round(Path(args.model), args.prompts, args.responses, args.seed) if args.policy
              else synthetic_round(args.prompts, args.responses, args.seed))
    rollout_cfg = RolloutConfig(max_response_length=round_.max_tokens, kv_cache_tokens=1 << 16,
                                max_running_requests=1024, seed=args.seed)
    engines = EngineSets(world, rollout_cfg, args.model, [EngineLayout(1)])
    if round_.lengths is not None:
        engines.engines[1] = ForcedLengths(engines.engines[1], round_.lengths)
    cfg = TrainerConfig(lr=1e-4, params_dtype="fp32", micro_batch_tokens=2048)
    trainer = Trainer(cfg, args.model, setup_layout(1, 1, 1))
    engines.active.resume_memory(list(MEMORY_TAGS))
    engines.push(trainer.iter_hf_tensors())
    snapshot = trainer.state_dict()
    coordinator = world.rank == 0

    def scheduler() -> Scheduler | None:
        if not coordinator:
            return None
        sched = SchedulerConfig(mode="tail_batching", p0=args.prompts, r0=args.responses,
                                planner=PlannerConfig(enabled=False))
        # a long round takes its prompts from the queue alone: no fresh prompt source
        return Scheduler(sched, rollout_cfg, None, rollout_ranks=world.size, stop_token_ids=round_.stop_token_ids)

    reward = InlineReward(round_.score)  # every rank's engine scores what it generates
    replica_of = replica_of_ranks(trainer.layout.dp_rank, world.control)
    trigger = (cfg.stream_trigger_low, cfg.stream_trigger_high)
    phases = {mode: RolloutPhase(engines, scheduler=scheduler(), reward=reward, trigger=trigger,
                                 replica_of=replica_of if mode == "stream" else None) for mode in MODES}
    load_before = list(os.getloadavg())
    repeats = []
    for rep in range(args.repeats):
        order = MODES if rep % 2 == 0 else MODES[::-1]
        runs = {mode: one_step(world, trainer, phases[mode], round_, snapshot) for mode in order}
        if coordinator:
            a, b = (runs[m].pop("params") for m in MODES)
            repeats.append({"order": list(order), **runs, "weight_rel_diff": float((a - b).norm() / a.norm())})
    for phase in phases.values():
        phase.close()
    engines.shutdown()
    if coordinator:
        payload = {"settings": {"round": "shipped policy" if args.policy else "synthetic lengths",
                                "prompts": args.prompts, "responses": args.responses, "repeats": args.repeats,
                                "seed": args.seed, "trigger": list(trigger)},
                   "caveat": CAVEAT, "load_before": load_before, "repeats": repeats}
        Path(args.payload).write_text(json.dumps(payload))
    world.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="HF Qwen2 dir (default: random, the policy's shape)")
    parser.add_argument("--policy", action="store_true",
                        help="sample a real long round from --model (the shipped policy and its task)")
    parser.add_argument("--out", help="write the raw results here (JSON), e.g. bench/results/stream.json")
    parser.add_argument("--payload", help=argparse.SUPPRESS)  # the worker's results, for the launcher
    args = parser.parse_args()
    if args.policy and args.model is None:
        args.model = str(REPO / "assets" / "policy")
    if "RANK" in os.environ:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_random_qwen2(Path(tmp) / "model", seed=args.seed, **POLICY_SHAPE))
        payload = Path(tmp) / "payload.json"
        argv = [str(Path(__file__).resolve()), "--prompts", str(args.prompts), "--responses", str(args.responses),
                "--repeats", str(args.repeats), "--seed", str(args.seed), "--model", model,
                "--payload", str(payload), *(["--policy"] if args.policy else [])]
        run_torchrun(2, argv, timeout=3600)
        results = json.loads(payload.read_text())
    if args.out:
        results = json.loads(write_results(args.out, results).read_text())
        print(f"raw results: {args.out}")
    else:
        results.update(command="(not written)", commit="-", date="-", machine="-")
    print(stream(results))


if __name__ == "__main__":
    main()
