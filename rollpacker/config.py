"""The run's configuration: one section per component, checked before any work.

``load_config`` reads a YAML file, applies ``section.key=value`` overrides and
builds the typed sections. ``check_layout`` then refuses layouts that cannot
run on the given world size (it reads the model's HF ``config.json`` for head
counts). Both raise ``ConfigError`` whose message names the key, the file and
the fix; the entry point calls them on every rank before any rank does work.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rollpacker.configlib import ConfigError, apply_overrides, build, load_yaml
from rollpacker.data.config import DataConfig
from rollpacker.eval import EvalConfig
from rollpacker.reward.config import RewardConfig
from rollpacker.rollout.config import RolloutConfig
from rollpacker.scheduler.config import SchedulerConfig
from rollpacker.scheduler.round import EngineLayout
from rollpacker.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from rollpacker.hf_spec import ModelSpec


@dataclass
class RunSection:
    name: str = "run"
    output_dir: str = "runs"
    # The trainer's torch seed. The data order (data.seed) and the rollout's sampling (rollout.seed)
    # have their own: an independent repeat of a run sets all three.
    seed: int = 1
    steps: int = 10
    save_every: int = 5  # steps between checkpoints; 0 disables periodic saves
    keep_checkpoints: int = 2
    # resume from this checkpoint step instead of the newest intact one (refused if it is absent or
    # damaged); the checkpoints after it are removed, as their steps are redone
    resume_from: int | None = None
    wandb: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "rollpacker"
    # steps between completions tables in W&B (a sample of the step's requests and what became of
    # each); 0: never
    log_samples_every: int = 10
    threads_per_rank: int = 1  # CPU threads per rank (torch.set_num_threads)
    verify_sync: bool = False  # after each weight sync, compare every engine shard with the trainer's tensors
    eval: EvalConfig = field(default_factory=EvalConfig)  # validation on data.eval_files while training

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.save_every < 0:
            raise ConfigError(f"save_every must be >= 0, got {self.save_every}")
        if self.resume_from is not None and self.resume_from < 1:
            raise ConfigError(f"resume_from must be a checkpoint's step (>= 1), got {self.resume_from}")
        if self.log_samples_every < 0:
            raise ConfigError(f"log_samples_every must be >= 0 (0: never), got {self.log_samples_every}")


@dataclass
class ModelSection:
    path: str = ""  # HF directory: config.json, *.safetensors, tokenizer

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("path must name a local HF model directory (config.json + safetensors)")


@dataclass
class Config:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    source: str = ""  # the file it was read from, for messages

    @property
    def longest_sequence(self) -> int:
        """Prompt + response tokens of the longest sequence the run can make."""
        return self.data.max_prompt_length + self.rollout.max_response_length

    @property
    def matched_window(self) -> int | None:
        """The fixed row width rollout.match_trainer makes the engine and the trainer compute at."""
        return self.longest_sequence if self.rollout.match_trainer else None

    def resolve(self, relative_to: Path) -> "Config":
        """Make model and data paths absolute relative to the repository root."""
        def fix(p: str) -> str:
            q = Path(p).expanduser()
            return str(q if q.is_absolute() else (relative_to / q).resolve())
        self.model.path = fix(self.model.path)
        self.data.train_files = [fix(p) for p in self.data.train_files]
        self.data.eval_files = [fix(p) for p in self.data.eval_files]
        return self


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    source = str(path)
    data = apply_overrides(load_yaml(path), list(overrides))
    data.pop("source", None)
    sections = {k: v for k, v in data.items()}
    cfg = build(Config, sections, where="", source=source)
    cfg.source = source
    return cfg


def _engine_layout_problem(spec: ModelSpec, layout: EngineLayout) -> str | None:
    """Why rollout engines of ``layout`` cannot hold the model of ``spec``, if they cannot."""
    if not spec.is_moe:
        return f"the model has no experts to split ({spec.model_type})" if layout.ep > 1 else None
    if spec.num_experts % layout.ep:
        return f"EP {layout.ep} does not divide the {spec.num_experts} experts"
    if spec.moe_intermediate_size % (layout.tp // layout.ep):
        return (f"the {layout.tp // layout.ep} ranks sharing an expert do not divide its intermediate size "
                f"{spec.moe_intermediate_size}")
    return None


def _check_experts(cfg: Config, hf_cfg: dict, world_size: int, hf: Path) -> None:
    """Refuse an expert layout the model at ``hf`` cannot take."""
    from rollpacker.hf_spec import parse_spec

    try:
        spec = parse_spec(hf_cfg)
        spec.check_ep(cfg.trainer.ep)
    except ValueError as exc:
        raise ConfigError(f"{cfg.source}: model.path {hf}: {exc} (trainer.ep)") from None
    planner = cfg.scheduler.planner
    for layout in planner.layout_choices(world_size, cfg.rollout.tp, cfg.rollout.ep):
        if problem := _engine_layout_problem(spec, layout):
            raise ConfigError(f"{cfg.source}: rollout engines of {layout} (rollout.tp/ep, scheduler.planner.*_tp, "
                              f"*_ep, max_tp, profile): {problem} (model.path {hf}); choose sizes whose EP divides the "
                              f"experts and whose TP/EP divides the experts' intermediate size (EP 1 on a dense model)")
    if spec.is_moe and cfg.rollout.backend == "sglang" and len(spec.moe_layers) != spec.num_layers:
        # sglang (0.5.17 and 0.5.23) builds every Qwen3-MoE layer sparse (models/qwen3_moe.py:
        # stage_facts's is_layer_sparse = True) and skips the dense layers' weights without a word
        raise ConfigError(f"{cfg.source}: model.path {hf}: dense layers {sorted(set(range(spec.num_layers)) - set(spec.moe_layers))} "
                          "(mlp_only_layers / decoder_sparse_step): sglang builds every Qwen3-MoE layer sparse and would "
                          "serve another model; use rollout.backend=reference, or a checkpoint whose layers are all sparse")
    t = cfg.trainer
    if t.routing_replay:
        problem = ("the model has no experts" if not spec.is_moe else
                   "the engine must report its routing: set rollout.return_routing=true" if not cfg.rollout.return_routing
                   else "a recomputed forward would replay another micro-batch's routing: set trainer.recompute=false"
                   if t.recompute else "context parallelism splits the tokens the routing names: set trainer.cp=1"
                   if t.cp > 1 else None)
        if problem:
            raise ConfigError(f"{cfg.source}: trainer.routing_replay=true: {problem} (model.path {hf})")


def check_layout(cfg: Config, world_size: int, *, require_files: bool = True) -> None:
    """Refuse layouts that cannot run on ``world_size`` ranks, naming the key and the fix."""
    src, t = cfg.source, cfg.trainer
    if cfg.run.verify_sync and cfg.rollout.backend == "sglang":
        # sglang 0.5.23 reads weights back only through the model's get_weights_by_name, which its Qwen
        # models lack (model_runner_components/weight_exporter.py: "TODO: Add support for Qwen models").
        raise ConfigError(
            f"{src}: run.verify_sync=true needs an engine that can read its weights back, which "
            "rollout.backend=sglang cannot; set run.verify_sync=false (the trainer's train/logprob_mismatch "
            "against the engine's log-probs shows a weight sync that did not land)")
    if t.ep > 1 and world_size % (t.tp * t.pp * t.ep):
        raise ConfigError(f"{src}: trainer.ep={t.ep}: trainer.tp*trainer.pp*trainer.ep = {t.tp * t.pp * t.ep} does not "
                          f"divide the world size {world_size}; choose an ep that divides {world_size // (t.tp * t.pp)}")
    if t.ep > 1 and t.stream:
        raise ConfigError(f"{src}: trainer.ep={t.ep} with trainer.stream=true: every sparse layer is a collective over "
                          "the expert-parallel ranks, which the stream trainer's replicas, training each on its own "
                          "schedule, cannot join; set trainer.stream=false (or trainer.ep=1)")
    model_parallel = t.tp * t.pp * t.cp
    if world_size % model_parallel:
        raise ConfigError(
            f"{src}: trainer.tp*trainer.pp*trainer.cp = {t.tp}*{t.pp}*{t.cp} = {model_parallel} does not divide "
            f"the world size {world_size}; choose sizes whose product divides {world_size}")
    dp = world_size // model_parallel
    batch = cfg.scheduler.p0 * cfg.scheduler.r0
    if batch % dp:
        raise ConfigError(
            f"{src}: scheduler.p0*scheduler.r0 = {batch} is not divisible by the data-parallel size {dp} "
            f"(world {world_size} / tp*pp*cp {model_parallel}); change scheduler.p0 or the layout")
    planner = cfg.scheduler.planner
    rollout_tps = {cfg.rollout.tp, *planner.tp_choices(world_size, cfg.rollout.tp)}
    if planner.enabled:
        rollout_tps |= {planner.short_tp, planner.long_tp}
    for tp in sorted(rollout_tps):
        if world_size % tp:
            raise ConfigError(f"{src}: rollout TP {tp} (rollout.tp / scheduler.planner.*_tp) does not divide "
                              f"the world size {world_size}")
    if cfg.rollout.match_trainer and (rollout_tps != {1} or (t.tp, t.pp, t.cp) != (1, 1, 1)):
        raise ConfigError(
            f"{src}: rollout.match_trainer reproduces the trainer's unsharded forward in one engine per rank: "
            f"it needs rollout TP 1 in every round (got {sorted(rollout_tps)} from rollout.tp / "
            f"scheduler.planner) and trainer.tp=pp=cp=1 (got {t.tp}/{t.pp}/{t.cp})")
    hf = Path(cfg.model.path) / "config.json"
    if not hf.is_file():
        if require_files:
            raise ConfigError(f"{src}: model.path: {cfg.model.path} has no config.json; "
                              "point model.path at a local HF model directory")
        return
    hf_cfg = json.loads(hf.read_text())
    _check_experts(cfg, hf_cfg, world_size, hf)
    heads = hf_cfg["num_attention_heads"]
    kv_heads = hf_cfg.get("num_key_value_heads", heads)
    for key, tp in [("trainer.tp", t.tp)] + [("rollout TP", x) for x in sorted(rollout_tps)]:
        if heads % tp or kv_heads % tp:
            raise ConfigError(
                f"{src}: {key}={tp} does not divide the model's attention heads ({heads}) and KV heads "
                f"({kv_heads}) from {hf}; use a TP size that divides {kv_heads} (the planner may pick any "
                f"power of two up to scheduler.planner.max_tp={planner.max_tp})")
    if require_files:
        for p in cfg.data.train_files:
            if not Path(p).is_file():
                raise ConfigError(f"{src}: data.train_files: {p} does not exist")
