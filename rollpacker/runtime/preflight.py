"""Everything that can be refused is refused here, on every rank, before any work.

Runs before the process group exists: each rank reads the same config and
files and reaches the same verdict, so a bad run fails everywhere at once
with one message (printed by rank 0) instead of hanging in a collective.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from rollpacker.config import Config, check_layout, load_config
from rollpacker.configlib import ConfigError
from rollpacker.plan import check_memory

REFUSED = 2  # the exit code of a run refused with one message (the launcher prints nothing after it)


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in the job, from torchrun's environment (or the launcher's plan)."""
    world_size: int
    ranks_per_node: int
    rank: int

    @classmethod
    def from_env(cls) -> "Ranks":
        world = int(os.environ.get("WORLD_SIZE", 1))
        return cls(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), int(os.environ.get("RANK", 0)))


@dataclass
class Preflight:
    cfg: Config
    tokenizer: object
    run_dir: Path
    finished_step: int | None  # the run already holds a checkpoint of its last step: nothing to do

    def finished_line(self) -> str:
        return (f"rollpacker: {self.run_dir} is complete: its checkpoint of step {self.finished_step} covers "
                f"run.steps={self.cfg.run.steps}; nothing to do (raise run.steps to train on)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rollpacker.train",
                                description="RollPacker GRPO training, one rank of the SPMD job (run under torchrun; "
                                            "rollpacker-train launches it)")
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny-cpu.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. trainer.lr=1e-6")
    return p.parse_args(argv)


def preflight(argv: list[str] | None, ranks: Ranks | None = None) -> Preflight:
    """Load and check the config, the model directory and the data; exit(REFUSED) with one message if unusable."""
    args = parse_args(argv)
    ranks = ranks or Ranks.from_env()
    run_dir = None
    try:
        cfg = load_config(args.config, args.overrides).resolve(Path.cwd())
        run_dir = (Path(cfg.run.output_dir) / cfg.run.name).resolve()
        finished = finished_step(cfg, run_dir)
        if finished is not None:
            return Preflight(cfg=cfg, tokenizer=None, run_dir=run_dir, finished_step=finished)
        check_layout(cfg, ranks.world_size)
        capped = fit_to_nodes(cfg, ranks.world_size, ranks.ranks_per_node)
        if capped and ranks.rank == 0:
            print(f"rollpacker: {capped}", file=sys.stderr)
        check_memory(cfg, ranks.world_size)  # GPU runs: every phase fits the device
        check_backends(cfg)
        check_weights(cfg.model.path, f"{cfg.source}: model.path")
        tokenizer = load_tokenizer(cfg.model.path, cfg.source)
        check_data(cfg, tokenizer)
    except (ConfigError, ValueError, FileNotFoundError, OSError) as exc:
        refuse(exc, ranks.rank, run_dir)
    return Preflight(cfg=cfg, tokenizer=tokenizer, run_dir=run_dir, finished_step=None)


def refuse(exc: BaseException, rank: int, run_dir: Path | None) -> None:
    """One message on the console (rank 0's), the traceback in RUN_DIR/logs/, exit(REFUSED)."""
    if rank == 0:
        print(f"rollpacker: cannot start: {exc}", file=sys.stderr, flush=True)
        if run_dir is not None:
            with contextlib.suppress(OSError):
                (run_dir / "logs").mkdir(parents=True, exist_ok=True)
                (run_dir / "logs" / "refused.log").write_text(traceback.format_exc())
    else:  # torchrun stops every rank once one exits: give rank 0 (same check, same error) time to report
        time.sleep(10)
    sys.exit(REFUSED)


def finished_step(cfg: Config, run_dir: Path) -> int | None:
    """The step of a checkpoint at or past ``run.steps`` (the run is done, a rerun has nothing to do);
    None when the run has steps left, or ``run.resume_from`` pins an earlier one."""
    from rollpacker.checkpoint import CheckpointManager

    latest = CheckpointManager(run_dir).latest()
    if cfg.run.resume_from is not None or latest is None or latest < cfg.run.steps:
        return None
    return latest


def check_backends(cfg: Config) -> None:
    """The rollout backend is installed and the trainer backend of this machine can run the dtype."""
    src = cfg.source
    if cfg.rollout.backend == "sglang" and importlib.util.find_spec("sglang") is None:
        raise ConfigError(f"{src}: rollout.backend=sglang, but SGLang is not installed in this Python "
                          f"({sys.executable}); install it with pip install -r requirements-gpu.txt (GPU nodes), "
                          "or set rollout.backend=reference (the PyTorch engine, CPU or GPU)")
    import torch

    if not torch.cuda.is_available() and cfg.trainer.params_dtype != "fp32":
        raise ConfigError(f"{src}: trainer.params_dtype={cfg.trainer.params_dtype}: without a GPU the trainer runs "
                          "Megatron's CPU backend, which trains in fp32 only (it keeps no fp32 master weights); "
                          "set trainer.params_dtype=fp32")
    if not torch.cuda.is_available() and cfg.rollout.backend == "sglang" and cfg.rollout.sglang_deterministic_inference:
        # sglang 0.5.23 srt/arg_groups/overrides.py:1117-1122 refuses it at engine start otherwise
        raise ConfigError(f"{src}: rollout.sglang_deterministic_inference=true needs one of sglang's GPU attention "
                          "backends (triton, fa3, fa4, flashinfer); an engine on CPU runs torch_native, which sglang "
                          "refuses for deterministic inference. Set it to false on CPU")
    engine_ep = max(cfg.scheduler.planner.ep_sizes(cfg.rollout.ep))
    if not torch.cuda.is_available() and cfg.rollout.backend == "sglang" and engine_ep > 1:
        # sglang 0.5.23 layers/moe/fused_moe_native.py:77 scatters the -1 that EP gives another rank's expert
        raise ConfigError(f"{src}: rollout EP {engine_ep} (rollout.ep / scheduler.planner.short_ep, long_ep, profile): "
                          "an sglang engine on CPU runs its plain-torch MoE, which cannot skip another rank's experts; "
                          "set them to 1 on CPU (each expert then splits over the engine's ranks), or "
                          "rollout.backend=reference")
    if torch.cuda.is_available() and cfg.rollout.match_trainer:
        raise ConfigError(f"{src}: rollout.match_trainer reproduces the CPU trainer's fixed-width forward; the GPU "
                          "trainer packs sequences with Transformer Engine kernels, which no engine reproduces "
                          "(docs/mismatch.md). Set it to false on a GPU")


def check_data(cfg: Config, tokenizer) -> None:
    """Every split reads, has usable rows, and names only data sources that a scorer handles."""
    from rollpacker.data.dataset import PromptDataset
    from rollpacker.eval import check_eval_files
    from rollpacker.reward.scorers import scorer_for

    check_eval_files(cfg)
    for split in ("train", "eval") if cfg.data.eval_files else ("train",):
        try:  # raises on a missing or unreadable file, or one with no usable rows
            dataset = PromptDataset.from_config(cfg.data, tokenizer, split=split)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{cfg.source}: data.{split}_files: {exc}") from None
        for source, count in dataset.data_sources().items():
            try:
                scorer_for(source)
            except ValueError as exc:
                raise ConfigError(f"{cfg.source}: data.{split}_files: {count} of {len(dataset)} prompts: {exc}; "
                                  "fix the rows' data_source or add a scorer (docs/formats.md)") from None


def fit_to_nodes(cfg: Config, world_size: int, ranks_per_node: int) -> str | None:
    """Keep every TP group inside a node; returns the line to log when the planner was capped.

    torchrun numbers a node's ranks consecutively and ``World`` builds each TP group from
    consecutive ranks, so a TP size fits when it divides the ranks per node (``LOCAL_WORLD_SIZE``).
    The planner's bounds and starting points (``scheduler.planner`` max_tp, short_tp, long_tp and
    profile rows) are capped to the largest power of two that does: it chooses TP per round anyway,
    and a larger TP could never run. Sizes the config fixes are refused with the fix: ``min_tp``
    (smaller engines' weights do not fit), ``rollout.tp`` and ``trainer.tp`` (the memory plan's).
    """
    cap = ranks_per_node & -ranks_per_node  # the largest power of two dividing it
    planner, t, src = cfg.scheduler.planner, cfg.trainer, cfg.source
    node = (f"a TP group never spans nodes, and a node has {ranks_per_node} rank(s) (LOCAL_WORLD_SIZE: "
            "torchrun --nproc_per_node, launch/train.sh NPROC_PER_NODE)")
    if planner.enabled and planner.min_tp > cap:
        raise ConfigError(f"{src}: scheduler.planner.min_tp={planner.min_tp} does not fit: {node}; run a multiple "
                          f"of {planner.min_tp} ranks per node (below min_tp an engine's weights do not fit)")
    if ranks_per_node % cfg.rollout.tp:
        raise ConfigError(f"{src}: rollout.tp={cfg.rollout.tp} does not fit: {node}; set rollout.tp={cap}")
    if ranks_per_node % t.tp:
        fits = math.gcd(t.tp, ranks_per_node)
        raise ConfigError(f"{src}: trainer.tp={t.tp} does not fit: {node}; set trainer.tp={fits} (with "
                          f"trainer.pp={t.pp * t.tp // fits} the model keeps as many parts: stages may span nodes)")
    if not planner.enabled or max(planner.tp_choices(world_size, cfg.rollout.tp)
                                  + [planner.short_tp, planner.long_tp]) <= cap:
        return None  # nothing the planner could choose is cut (single node: always)
    changes = [f"{key} {getattr(planner, key)}->{cap}" for key in ("max_tp", "short_tp", "long_tp")
               if getattr(planner, key) > cap]
    dropped = [row.tp for row in planner.profile if row.tp > cap]
    if dropped:
        changes.append(f"profile rows of TP {dropped} dropped")
    planner.max_tp, planner.short_tp, planner.long_tp = (min(v, cap) for v in (planner.max_tp, planner.short_tp,
                                                                               planner.long_tp))
    planner.profile = [row for row in planner.profile if row.tp <= cap]
    return f"scheduler.planner capped to TP {cap} ({', '.join(changes)}): {node}"


def load_tokenizer(model_dir: str, source: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many types for a missing/broken tokenizer
        raise ConfigError(f"{source}: model.path: cannot load a tokenizer from {model_dir}: {exc}") from None


def check_weights(model_dir: str | Path, where: str) -> None:
    """Every safetensors file of ``model_dir`` opens (its header only: no tensor is read) and together
    they hold every tensor its config.json implies, each of that shape. Raises ConfigError naming
    ``where``, the file and the tensor."""
    from safetensors import SafetensorError, safe_open

    from rollpacker.hf_spec import parse_spec

    model_dir = Path(model_dir)
    try:
        expected = parse_spec(model_dir).hf_shapes()
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as f:
                found.update((name, (file, tuple(f.get_slice(name).get_shape()))) for name in f.keys())
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"{where}: {file} is not a readable safetensors file ({exc}); copy it again") from None
    missing = [name for name in expected if name not in found]
    if missing:
        raise ConfigError(f"{where}: no safetensors file in {model_dir} holds {missing[0]}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which its config.json "
                          "implies: the weights are incomplete or belong to another config")
    for name, shape in expected.items():
        file, got = found[name]
        if got != shape:
            raise ConfigError(f"{where}: {file}: tensor {name} has shape {list(got)}, its config.json implies "
                              f"{list(shape)}")
