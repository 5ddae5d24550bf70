"""Validation during training: the eval of one step's weights, as every rank runs it.

Where it sits (``rollpacker.train``): the weights after step N's optimizer step reach the engines
in the weight sync at the start of step N+1 (``Run.sync_weights``), and nothing changes them
until step N+1's optimizer step. So the eval of step N runs right after that sync, before step
N+1's rollout, on step N+1's engine set: the engines hold exactly step N's weights, the eval costs
no extra weight push, and under the planner's regrouping it uses whatever engine set (TP size) the
round chose. The eval before training (step 0) is the same with the starting weights; after the
last step no round follows, and ``Run.evaluate`` pushes the weights itself.

Since step N is checkpointed before its eval starts, a kill during the eval resumes from step N
and repeats the eval, not the training step; an eval whose line is in ``metrics.jsonl`` (kept by
the resume, as it follows its step's checkpoint) is not repeated.

Training does not see an eval: its requests carry their own ids (``eval<step>/...``) and explicit
seeds from (eval seed, step, sampling, file, prompt, sample), so no engine seed stream moves; the
scheduler, its queue and history, the dataset cursor and the ledger are not touched; its scores
do not adapt the reward pool's code timeouts.

Rank 0 shards the eval requests over every engine of the set (its own in-process, the others
through their servers, as in a round), keeps at most each engine's running limit outstanding so
that an engine that is done early takes more, and submits every response to the reward pool as
it finishes.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
import zlib
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rollpacker.config import Config
from rollpacker.eval import EvalConfig, EvalRecord, eval_prompts, summarize
from rollpacker.reward.pool import RewardPool
from rollpacker.rollout.engine import GenerationRequest, RolloutEngine, SamplingParams
from rollpacker.runtime.rollout_phase import RolloutPhase
from rollpacker.sample import Prompt
from rollpacker.scheduler.clock import RealClock
from rollpacker.scheduler.dispatch import EngineDriver

log = logging.getLogger("rollpacker")


class EvalPhase:
    def __init__(self, cfg: Config, rollout: RolloutPhase, *, tokenizer: Any, pool: RewardPool | None,
                 run_dir: Path, stop_token_ids: tuple[int, ...]):
        """Every rank; rank 0 (``pool`` given) tokenizes the eval files and drives the eval."""
        self.cfg: EvalConfig = cfg.run.eval
        self.enabled = self.cfg.enabled(cfg.data.eval_files)
        self.last_step = cfg.run.steps
        self.rollout, self.pool = rollout, pool
        self.dir = run_dir / "eval"
        self.done: set[int] = set()  # steps whose eval is logged
        self.max_running = cfg.rollout.max_running_requests
        self.params = {s.name: (s.n, SamplingParams(
            temperature=cfg.rollout.temperature if s.temperature is None else s.temperature,
            top_p=cfg.rollout.top_p if s.top_p is None else s.top_p,
            top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_response_length if s.max_response_length is None
            else s.max_response_length,
            stop_token_ids=stop_token_ids)) for s in self.cfg.samplings}
        self.files = eval_prompts(cfg, tokenizer) if self.enabled and pool is not None else []
        if self.cfg.every and not cfg.data.eval_files and pool is not None:
            log.warning("run.eval.every=%d but data.eval_files is empty: the run does not evaluate", self.cfg.every)

    def due(self, step: int) -> bool:
        return self.enabled and step not in self.done and self.cfg.due(step, self.last_step)

    def share_done(self, done: set[int] | None, group: dist.ProcessGroup) -> None:
        """Collective: rank 0's logged evals (read from metrics.jsonl at resume) on every rank."""
        box = [done]
        dist.broadcast_object_list(box, src=0, group=group)
        self.done = set(box[0] or ())

    def run(self, step: int) -> dict[str, float] | None:
        """Collective over the world: evaluate the weights the awake engines hold; the metrics on rank 0."""
        result, _ = self.rollout.on_engines(lambda engines: self._drive(step, engines))
        self.done.add(step)
        return result

    # --- rank 0 ----------------------------------------------------------------------------------
    def _requests(self, step: int) -> dict[str, tuple[GenerationRequest, str, str, Prompt, int]]:
        out = {}
        for name, (n, params) in self.params.items():
            for key, prompts in self.files:
                for p in prompts:
                    for k in range(n):
                        rid = f"eval{step}/{name}/{key}/p{p.uid}r{k}"
                        seed = zlib.crc32(f"{self.cfg.seed}:{step}:{name}:{key}:{p.uid}:{k}".encode())
                        request = GenerationRequest(rid, p.input_ids, dataclasses.replace(params, seed=seed))
                        out[rid] = (request, name, key, p, k)
        return out

    def _drive(self, step: int, engines: list[RolloutEngine]) -> dict[str, float]:
        start = time.monotonic()
        log.info("eval of step %d: started on %d engine(s)", step, len(engines))
        requests = self._requests(step)
        waiting = deque(requests)
        driver = EngineDriver(engines, RealClock())
        window = self.max_running * len(engines)
        scoring: dict[str, Any] = {}
        records: dict[str, EvalRecord] = {}
        finished_at: dict[tuple[str, str], float] = {}
        tokens = 0
        while waiting or driver.outstanding or scoring:
            if waiting and driver.outstanding < window:
                driver.submit(requests[waiting.popleft()][0] for _ in range(min(len(waiting),
                                                                                window - driver.outstanding)))
            if driver.outstanding:
                for c in driver.poll():
                    _, name, key, p, k = requests[c.request_id]
                    tokens += len(c.output_ids)
                    # adapt=False: the code timeouts learned from training prompts stay as training left them
                    future = self.pool.submit(p.data_source, c.output_ids, p.ground_truth, adapt=False)
                    future.add_done_callback(lambda _: driver.wake())  # a score ends the driver's wait
                    scoring[c.request_id] = (c, future)
            else:  # only scores are left to come
                wait([f for _, f in scoring.values()], return_when=FIRST_COMPLETED)
            for rid, (c, future) in list(scoring.items()):
                if future.done():
                    del scoring[rid]
                    _, name, key, p, k = requests[rid]
                    score = future.result()
                    records[rid] = EvalRecord(name, key, p.data_source, p.uid, k, tuple(c.output_ids),
                                              c.finish_reason, float(score.reward), bool(score.correct))
                    now = time.monotonic() - start
                    for group in ("", f"file/{key}/", f"source/{p.data_source}/"):
                        finished_at[(name, group)] = now
        self.rollout.stop_servers(engines, released=lambda eid: False)
        seconds = time.monotonic() - start
        ordered = [records[rid] for rid in requests]
        self._write_samples(step, ordered)
        metrics = summarize(ordered, finished_at)
        metrics.update({"eval/seconds": seconds, "eval/generated_tokens": float(tokens),
                        "eval/engines": float(len(engines))})
        return metrics

    def _write_samples(self, step: int, records: list[EvalRecord]) -> None:
        """Every scored response of the eval, for inspection (rewritten if the eval is repeated)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step:06d}.jsonl"
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as f:
            for r in records:
                f.write(json.dumps({"sampling": r.sampling, "file": r.file, "uid": r.uid, "sample": r.sample,
                                    "data_source": r.data_source, "response_ids": list(r.response_ids),
                                    "finish_reason": r.finish_reason, "reward": r.reward,
                                    "correct": r.correct}) + "\n")
        tmp.replace(path)
