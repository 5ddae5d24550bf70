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

Rank 0 runs the eval as a round (``RoundRunner``, ``RoundKind.EVAL``) that keeps every group (a
prompt's samples of one sampling): its groups are placed over every engine of the set as a
training round's are, at most each engine's running limit outstanding so that an engine that is
done early takes more, and each engine scores its responses on its node's reward pool as they
finish; a group comes back to rank 0 once all its samples are scored.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tqdm import tqdm

from rollpacker.config import Config
from rollpacker.eval import EvalConfig, EvalRecord, eval_prompts, summarize
from rollpacker.rollout.engine import SamplingParams
from rollpacker.runtime.rollout_phase import RolloutPhase
from rollpacker.scheduler.protocols import Fleet
from rollpacker.scheduler.round import RoundKind, RoundPlan
from rollpacker.scheduler.round_runner import EngineDriver, RoundRunner
from rollpacker.scheduler.group_race import GroupLaunch

log = logging.getLogger("rollpacker")


class EvalPhase:
    def __init__(self, cfg: Config, rollout: RolloutPhase, *, tokenizer: Any, run_dir: Path,
                 stop_token_ids: tuple[int, ...]):
        """Every rank; rank 0 tokenizes the eval files and drives the eval."""
        self.cfg: EvalConfig = cfg.run.eval
        self.enabled = self.cfg.enabled(cfg.data.eval_files)
        self.last_step = cfg.run.steps
        self.rollout = rollout
        coordinator = rollout.rank == 0
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
        self.files = eval_prompts(cfg, tokenizer) if self.enabled and coordinator else []
        if self.cfg.every and not cfg.data.eval_files and coordinator:
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
        result, _ = self.rollout.on_engines(lambda fleet: self._drive(step, fleet))
        self.done.add(step)
        return result

    # --- rank 0 ----------------------------------------------------------------------------------
    def _groups(self, step: int) -> list[tuple[GroupLaunch, str, str]]:
        """(group, sampling name, file key) of every eval prompt and sampling; request ids and seeds
        from (eval seed, step, sampling, file, prompt, sample), not from any engine's stream."""
        out = []
        for name, (n, params) in self.params.items():
            for key, prompts in self.files:
                for p in prompts:
                    # reward_key None: code timeouts from the tests' content, never a training prompt's
                    # uid; adapt False: the timeouts learned from training prompts stay as training left them
                    out.append((GroupLaunch(len(out), p, n, n, f"eval{step}/{name}/{key}/p{p.uid}r",
                                            f"{self.cfg.seed}:{step}:{name}:{key}:{p.uid}:", params,
                                            reward_key=None, adapt=False), name, key))
        return out

    def _drive(self, step: int, fleet: Fleet) -> dict[str, float]:
        """The eval as a round that keeps every group, placed as room frees on the engines."""
        log.info("eval of step %d: started on %d engine(s)", step, fleet.size)
        groups = self._groups(step)
        launches = [g for g, _, _ in groups]
        awake = self.rollout.engines.choice
        plan = RoundPlan(index=step, kind=RoundKind.EVAL, tp=awake.tp, prompts=tuple(g.prompt for g in launches),
                         n_responses=max(g.n for g in launches), target_groups=len(launches), ep=awake.ep)
        # Only on a terminal (disable=None): a log file keeps the step lines without a bar's redraws.
        bar = tqdm(total=len(groups), unit="group", desc=f"eval of step {step}", disable=None, leave=False)
        start = fleet.clock.now()
        runner = RoundRunner(plan, driver=EngineDriver(fleet), launches=launches, async_reward=True,
                             keeps=lambda _: True, replacement=lambda: None, on_group_done=lambda _: bar.update(),
                             limit=max(self.max_running, plan.n_responses))  # a larger group runs alone
        result = runner.run()
        bar.close()
        records, finished_at = [], {}
        for (_, name, key), done in zip(groups, result.completed):
            p = done.prompt
            samples = sorted(done.samples, key=lambda s: s.response_index)
            records += [EvalRecord(name, key, p.data_source, p.uid, s.response_index, tuple(s.response_ids),
                                   s.finish_reason, float(s.reward), bool(s.correct)) for s in samples]
            last = max(s.scored_at for s in samples) - start
            for group in ("", f"file/{key}/", f"source/{p.data_source}/"):
                finished_at[(name, group)] = max(finished_at.get((name, group), 0.0), last)
        self._write_samples(step, records)
        metrics = summarize(records, finished_at)
        metrics.update({"eval/seconds": fleet.clock.now() - start,
                        "eval/generated_tokens": float(result.stats.generated_tokens),
                        "eval/engines": float(fleet.size)})
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
