"""Everything that can be refused is refused here, on every rank, before any work.

Runs before the process group exists: each rank reads the same config and
files and reaches the same verdict, so a bad run fails everywhere at once
with one message (printed by rank 0) instead of hanging in a collective.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rollpacker.config import Config, check_layout, load_config
from rollpacker.configlib import ConfigError
from rollpacker.plan import check_memory


@dataclass
class Preflight:
    cfg: Config
    tokenizer: object
    run_dir: Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollpacker.train", description="RollPacker GRPO training (run under torchrun)")
    p.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny-cpu.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. trainer.lr=1e-6")
    return p.parse_args(argv)


def preflight(argv: list[str] | None) -> Preflight:
    """Load and check the config, the model directory and the data; exit(2) with one message if unusable."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides).resolve(Path.cwd())
        check_layout(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        check_memory(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # GPU runs: every phase fits the device
        tokenizer = load_tokenizer(cfg.model.path, cfg.source)
        from rollpacker.data.dataset import PromptDataset
        from rollpacker.eval import check_eval_files
        check_eval_files(cfg)
        for split in ("train", "eval") if cfg.data.eval_files else ("train",):
            try:  # raises on a missing or unreadable file, or one with no usable rows
                PromptDataset.from_config(cfg.data, tokenizer, split=split)
            except (ValueError, OSError) as exc:
                raise ConfigError(f"{cfg.source}: data.{split}_files: {exc}") from None
    except (ConfigError, ValueError, FileNotFoundError, OSError) as exc:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"rollpacker: cannot start: {exc}", file=sys.stderr)
        else:  # torchrun stops every rank once one exits: give rank 0 (same check, same error) time to report
            time.sleep(10)
        sys.exit(2)
    return Preflight(cfg=cfg, tokenizer=tokenizer, run_dir=(Path(cfg.run.output_dir) / cfg.run.name).resolve())


def load_tokenizer(model_dir: str, source: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many types for a missing/broken tokenizer
        raise ConfigError(f"{source}: model.path: cannot load a tokenizer from {model_dir}: {exc}") from None
