"""One training run: the components of every rank and the phases of a step.

``rollpacker.train`` reads as the phases in order; this module holds what
each phase does. Rank 0 owns the coordinator state (data, scheduler, reward
pool, ledger, metrics); every rank owns its engines and its trainer shard.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch.distributed as dist

from megatron_ext.parallel import setup_layout
from rollpacker.checkpoint import CheckpointManager, FileFault
from rollpacker.configlib import ConfigError, to_dict
from rollpacker.data.dataset import PromptDataset
from rollpacker.metrics import MetricsLogger, Timeline, plot_timeline
from rollpacker.memory_phases import Phase, PhaseMachine
from rollpacker.reward.service import NodeReward
from rollpacker.rollout_report import TABLE_COLUMNS, completion_rows, plot_gantt
from rollpacker.runtime.console import Console, write_config
from rollpacker.runtime.engines import EngineSets
from rollpacker.runtime.eval_phase import EvalPhase
from rollpacker.runtime.ledger import PromptLedger
from rollpacker.runtime.preflight import Preflight, check_weights
from rollpacker.runtime.rollout_phase import RolloutPhase, broadcast_groups
from rollpacker.runtime.streaming import replica_of_ranks
from rollpacker.runtime.world import World
from rollpacker.scheduler import Scheduler
from rollpacker.scheduler.round import RoundPlan, RoundResult
from rollpacker.trainer.trainer import Trainer

log = logging.getLogger("rollpacker")


class Run:
    def __init__(self, pre: Preflight, world: World):
        cfg, self.cfg, self.world, self.run_dir = pre.cfg, pre.cfg, world, pre.run_dir
        self.tokenizer = pre.tokenizer
        self.timeline = Timeline(world.rank)
        planner = cfg.scheduler.planner
        tp_sizes = planner.tp_choices(world.size, cfg.rollout.tp)
        world.build_rollout_layouts(tp_sizes)
        choices = planner.layout_choices(world.size, cfg.rollout.tp, cfg.rollout.ep)
        # Engines first: an engine sizes its KV pool from the device memory free when it starts, and
        # during rollout the trainer is offloaded, so it must not be resident yet (SGLang takes a
        # fraction of what is free at init).
        self.engines = EngineSets(world, cfg.rollout, cfg.model.path, choices, window=cfg.matched_window)
        layout = setup_layout(cfg.trainer.tp, cfg.trainer.pp, cfg.trainer.cp, ep=cfg.trainer.ep, seed=cfg.run.seed)
        self.trainer = Trainer(cfg.trainer, cfg.model.path, layout, row_width=cfg.matched_window)
        self.phases = PhaseMachine(self.trainer, self.engines.awake, self.timeline,
                                   barrier=self.engines.device_barrier)
        self.ckpt = CheckpointManager(self.run_dir, keep=cfg.run.keep_checkpoints, group=world.control)
        self.ckpt.install_stop_handlers()
        self.coordinator = world.rank == 0
        scheduler = None
        if self.coordinator:
            self.dataset = PromptDataset.from_config(cfg.data, pre.tokenizer)
            scheduler = Scheduler(cfg.scheduler, cfg.rollout, self.dataset, rollout_ranks=world.size,
                                  stop_token_ids=[pre.tokenizer.eos_token_id],
                                  async_reward=cfg.reward.async_scoring)
        self.scheduler = scheduler
        if cfg.trainer.stream and world.size // min(tp_sizes) < 2 and world.rank == 0:
            log.warning("trainer.stream: long rounds run one engine over all %d ranks, so none can leave for "
                        "the stream trainer; streaming needs >= 2 long-round engines (a smaller rollout TP)",
                        world.size)
        # a rank's training replica decides whether its engine may leave a long round to stream-train
        replica_of = replica_of_ranks(layout.dp_rank, world.control) if cfg.trainer.stream else None
        # one reward pool per node, on its first rank: the node's engines score their responses there
        self.node_reward = NodeReward(cfg.reward, tokenizer=pre.tokenizer, lead=world.node_lead,
                                      local_size=world.local_size, group=world.control)
        # The deterministic race fixes which prompts a round trains; a streamed step must then also fix
        # which replica trains each and in what order, whatever the split the hand-off's timing made.
        self.fixed_assignment = cfg.trainer.stream and cfg.scheduler.races_by_length(cfg.rollout.seeded)
        self.rollout_phase = RolloutPhase(self.engines, scheduler=scheduler, reward=self.node_reward.sink,
                                          replica_of=replica_of, engine_wait_s=cfg.scheduler.idle_poll_s,
                                          trigger=(cfg.trainer.stream_trigger_low, cfg.trainer.stream_trigger_high),
                                          fixed_feed=self.fixed_assignment)
        self.eval_phase = EvalPhase(cfg, self.rollout_phase, tokenizer=pre.tokenizer, run_dir=self.run_dir,
                                    stop_token_ids=(pre.tokenizer.eos_token_id,))
        self.seconds: dict[str, float] = {}
        self.stopped = False  # a stop signal (scancel: SIGTERM, Ctrl-C: SIGINT) ended the run early

    # --- resume ----------------------------------------------------------------------------------
    def resume(self) -> int:
        """Restore the newest checkpoint that every rank finds intact (or ``run.resume_from``); returns its
        step, 0 without one. No intact checkpoint, or a damaged record, stops the run with one message."""
        with self.stops_on_file_faults():
            step = self.ckpt.resume_step(self.cfg.run.resume_from)
            reward_state = None
            if step is not None:
                rank_state, shared = self.ckpt.load(step)
                self.trainer.load_state_dict(rank_state["trainer"])
                if self.coordinator:
                    self.dataset.load_state_dict(shared["data"])
                    self.scheduler.load_state_dict(shared["scheduler"])
                    reward_state = shared["reward"]
                log.info("resumed from step %d (%s)", step, self.ckpt.path(step))
            self.node_reward.load_everywhere(reward_state)  # every node's pool times code as rank 0's did

            def open_records() -> None:  # a torn last line is dropped (and logged), other damage refused
                if self.coordinator:
                    self.ledger = PromptLedger(self.run_dir, resume_step=step or 0)
                    self.metrics = MetricsLogger(self.run_dir, rank=0, wandb_mode=self.cfg.run.wandb,
                                                 project=self.cfg.run.wandb_project, name=self.cfg.run.name,
                                                 config=to_dict(self.cfg), resume_step=step or 0)
                    write_config(self.cfg, self.run_dir)
                    self.console = Console(self.cfg, self.run_dir, first_step=(step or 0) + 1)
            self.ckpt.agreed(open_records)
        # an eval logged after the checkpoint's step is kept with it and not repeated; one cut short is
        self.eval_phase.share_done(self.metrics.steps_with("eval/") if self.coordinator else None,
                                   self.world.control)
        return step or 0

    # --- the phases of a step --------------------------------------------------------------------
    def plan_round(self) -> RoundPlan | None:
        """Rank 0 plans the round; every rank selects the engine set of the round's layout."""
        self._step_started = time.monotonic()
        plan = self.scheduler.plan_round() if self.coordinator else None
        box = [plan.layout if plan else None]
        dist.broadcast_object_list(box, src=0, group=self.world.control)
        self.engines.select(box[0])
        return plan

    def sync_weights(self) -> None:
        """Wake the round's engines and load the trainer's current weights into them."""
        with self._timed("sync"):
            self.phases.to(Phase.SYNC)
            self.seconds.update(self.engines.push(self.trainer.iter_hf_tensors()))
        if self.cfg.run.verify_sync:
            self.seconds["sync/max_abs_diff"] = self.engines.max_weight_diff(self.trainer.iter_hf_tensors())

    def evaluate(self, step: int) -> None:
        """If due and not logged yet: evaluate the weights after ``step`` (0: the starting policy) on
        the awake engine set, which the last sync loaded with them (see eval_phase.py)."""
        if not self.eval_phase.due(step):
            return
        own_sync = self.phases.phase is Phase.TRAIN  # after the last step no round's sync precedes it
        if own_sync:
            self.sync_weights()
        self.phases.to(Phase.ROLLOUT)
        with self._timed("eval"):
            metrics = self.eval_phase.run(step)
        if own_sync:
            self.phases.to(Phase.TRAIN)
        if self.coordinator:
            self.metrics.log(step, metrics)
            log.info(self.console.eval_line(step, metrics))

    def rollout(self, plan: RoundPlan | None) -> RoundResult | None:
        """The round; a rank whose engine is handed to the stream trainer trains from then on."""
        self.phases.to(Phase.ROLLOUT)
        layout = self.engines.layout
        role = "rollout" if self.coordinator else "serve" if layout.is_leader else "follow"
        with self._timed(role):
            result, to_training = self.rollout_phase.run(plan)
        if to_training:
            self.phases.to(Phase.TRAIN)
            with self._timed("stream_train"):
                self.rollout_phase.stream_train(self.trainer.stream)
        return result

    def train(self, result: RoundResult | None) -> dict[str, float]:
        """Train on the groups not streamed during rollout, then take the step's one optimizer step."""
        self.phases.to(Phase.TRAIN)
        with self._timed("train"):
            groups = broadcast_groups(self.rollout_phase.unstreamed(result), self.world.control)
            # Groups arrive in completion order, which depends on timing; a canonical order
            # makes the update bit-reproducible (a resumed run repeats the uninterrupted one).
            groups = sorted((sorted(g, key=lambda s: s.response_index) for g in groups),
                            key=lambda g: (g[0].prompt.epoch, g[0].prompt.uid))
            self.trainer.begin_step()
            return self.trainer.finish_step(groups, fixed=self.fixed_assignment)

    def end_step(self, step: int, result: RoundResult | None, train_metrics: dict[str, float]) -> bool:
        """Metrics, timeline, ledger and checkpoint; returns True when the run must stop now."""
        self.node_reward.share_code_timeouts()  # rank 0's pool, which the checkpoint saves, learns the others'
        spans = self.timeline.gather(self.world.control)
        stop = self.ckpt.any_stop_requested()
        every = self.cfg.run.save_every

        def record(checkpoint_started: float | None = None) -> None:
            # Written before the step's checkpoint is marked complete: a kill after the commit would
            # otherwise resume past a step that the ledger and metrics lack (a resume drops the lines
            # of steps after its checkpoint, so writing them early is safe).
            if checkpoint_started is not None:  # the checkpoint's files, written
                self.seconds["time/checkpoint_s"] = time.monotonic() - checkpoint_started
            self.seconds["time/step_s"] = time.monotonic() - self._step_started  # wall time, checkpoint included
            if self.coordinator:
                self.ledger.record(step, [g.prompt for g in result.kept], result.filtered)
                metrics = self._step_metrics(result, train_metrics)
                self.metrics.log(step, metrics, **self._step_media(step, spans, result))
                log.info(self.console.step_line(step, metrics))

        with self.stops_on_file_faults():  # a full disk: the checkpoint or the step's records
            if stop or (every and step % every == 0) or step == self.cfg.run.steps:
                with self.timeline.span("checkpoint"):
                    started = time.monotonic()
                    self.save(step, before_commit=lambda: record(started))
            else:
                self.ckpt.agreed(record)
        self.seconds = {}
        self.stopped = stop
        return stop

    def save(self, step: int, before_commit: Callable[[], None] | None = None) -> None:
        shared = None
        if self.coordinator:
            shared = {"step": step, "data": self.dataset.state_dict(), "scheduler": self.scheduler.state_dict(),
                      "reward": self.node_reward.state_dict()}
        self.ckpt.save(step, {"trainer": self.trainer.state_dict()}, shared, export=self._export_hf,
                       before_commit=before_commit)

    def _export_hf(self, ckpt_dir: Path) -> None:
        """The policy as an HF directory in the checkpoint, checked as model.path is at preflight."""
        self.trainer.save_hf(ckpt_dir / "hf")
        if self.coordinator:
            try:
                check_weights(ckpt_dir / "hf", f"the HF export of {ckpt_dir.name}")
            except ConfigError as exc:
                raise FileFault(str(exc)) from None

    @contextlib.contextmanager
    def stops_on_file_faults(self) -> Iterator[None]:
        """A FileFault comes on every rank at once (they agreed on it): rank 0 prints it, every rank
        closes its engines and workers and exits 2; one message instead of a traceback per rank."""
        try:
            yield
        except FileFault as exc:
            if self.coordinator:
                print(f"rollpacker: stopped: {exc}", file=sys.stderr, flush=True)
            dist.barrier(group=self.world.control)  # printed before any rank exits and torchrun ends the rest
            self.close()
            self.world.shutdown()
            raise SystemExit(2) from None

    def summary(self) -> None:
        """Rank 0 prints the run's summary: steps, time, evals, where its files are."""
        if self.coordinator:
            latest = self.ckpt.latest()
            print("rollpacker: " + self.console.summary(
                stopped=self.stopped, checkpoint=None if latest is None else self.ckpt.path(latest),
                wandb=self.metrics.wandb_where), file=sys.stderr, flush=True)

    def close(self) -> None:
        self.rollout_phase.close()
        self.engines.shutdown()
        self.node_reward.close()
        if self.coordinator:
            if hasattr(self, "metrics"):  # not opened when the resume was refused
                self.metrics.close()

    # --- helpers ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """A span on this rank's timeline whose seconds also go into the step's metrics."""
        with self.timeline.span(phase):
            yield
        span, key = self.timeline.spans[-1], f"time/{phase}_s"
        self.seconds[key] = self.seconds.get(key, 0.0) + span.end - span.start

    def _step_media(self, step: int, spans: list, result: RoundResult) -> dict[str, Any]:
        """The step's timeline and rollout Gantt (files in RUN_DIR/timeline/), and on every
        ``run.log_samples_every``-th step its completions table (W&B only)."""
        timeline = self.run_dir / "timeline"
        media: dict[str, Any] = {"images": {
            "perf/timeline": plot_timeline(spans, timeline / f"step_{step:06d}.png", f"step {step}"),
            "rollout/gantt": plot_gantt(result.trace, timeline / f"step_{step:06d}_requests.png",
                                        f"step {step}: {result.kind.value} round, engines of TP {result.tp} EP {result.ep}, "
                                        f"{len(result.trace.requests)} requests")}}
        every = self.cfg.run.log_samples_every
        if every and step % every == 0:
            rows = completion_rows(step, result, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
            media["tables"] = {"rollout/completions": (TABLE_COLUMNS, rows)}
        return media

    def _step_metrics(self, result: RoundResult, train: dict[str, float]) -> dict[str, Any]:
        s = result.stats
        samples = result.samples
        lengths = np.array([x.num_response_tokens for x in samples])
        rewards = np.array([x.reward for x in samples], dtype=float)
        return {
            "round": result.kind.value, "rollout_tp": result.tp, "rollout_ep": result.ep,
            "prompts_launched": s.launched_prompts,
            "responses_launched": s.launched_responses, "prompts_kept": s.kept_prompts,
            "responses_kept": len(samples), "groups": len(result.groups),
            "group_sizes": sorted({len(g) for g in result.groups}),
            "rollout_s": s.rollout_seconds, "reward_s": s.reward_seconds, "bubble_fraction": s.bubble_fraction,
            "generated_tokens": s.generated_tokens, "wasted_tokens": s.wasted_tokens, "preemptions": s.preemptions,
            "queue_length": s.queue_length, "deferred_prompts": s.deferred_prompts,
            "migrated_requests": s.migrated_requests, "migrated_tokens": s.migrated_tokens,
            "handoff_fraction": s.handoff_fraction, "streamed_groups": len(self.rollout_phase.streamed),
            "filtered_prompts": s.filtered_prompts, "routed_prompts_total": self.scheduler.counters["routed"],
            "response_len_p50": float(np.percentile(lengths, 50)), "response_len_p90": float(np.percentile(lengths, 90)),
            "response_len_p99": float(np.percentile(lengths, 99)), "response_len_max": int(lengths.max()),
            "reward_mean": float(rewards.mean()),
            "accuracy": float(np.mean([bool(x.correct) for x in samples])),
            **self.seconds, **self.phases.pop_seconds(),
            **{(k if k.startswith("mismatch/") else f"train/{k}"): v for k, v in train.items()},
            # the gap per round kind too: long rounds' long responses are where it accumulates
            **{f"mismatch/{result.kind.value}/{k.split('/', 1)[1]}": v for k, v in train.items()
               if k.startswith("mismatch/") and k.count("/") == 1},
        }
