"""What rank 0 prints while a run trains: one line per step and per eval, and the run's summary.

Every figure on these lines is also in ``metrics.jsonl`` (and W&B); the console is for the person
watching, so a line carries what tells a healthy step from a sick one (time and ETA, throughput,
reward, response length, loss, KL, gradient norm) and the summary says where everything went.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import yaml

from rollpacker.config import Config
from rollpacker.configlib import to_dict

CONFIG_FILE = "config.yaml"  # the resolved config of the run's latest start, in the run directory


def write_config(cfg: Config, run_dir: Path) -> Path:
    """The config as this start resolved it (file, overrides, absolute paths), for the run's record."""
    path = run_dir / CONFIG_FILE
    path.write_text(f"# resolved from {cfg.source} by the run's latest start\n"
                    + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60 else f"{rest}s"


class Console:
    """Rank 0's step and eval lines, with an ETA from the wall time of the steps this start ran."""

    def __init__(self, cfg: Config, run_dir: Path, first_step: int):
        self.total, self.run_dir, self.first_step = cfg.run.steps, run_dir, first_step
        self.samplings = [s.name for s in cfg.run.eval.samplings]
        self.started = time.monotonic()
        self.last_step = first_step - 1

    def step_line(self, step: int, m: dict[str, Any]) -> str:
        self.last_step = step
        elapsed = time.monotonic() - self.started
        eta = elapsed / (step - self.first_step + 1) * (self.total - step)
        tokens_per_s = m["generated_tokens"] / m["rollout_s"] if m["rollout_s"] > 0 else 0.0
        ep = f" ep={m['rollout_ep']}" if m.get("rollout_ep", 1) > 1 else ""
        return (f"step {step}/{self.total} {m['round']} tp={m['rollout_tp']}{ep} | {m['time/step_s']:.1f}s, "
                f"ETA {duration(eta)} | {tokens_per_s:,.0f} tok/s | reward {m['reward_mean']:.3f} | "
                f"len {m['response_len_p50']:.0f} (p90 {m['response_len_p90']:.0f}) | "
                f"loss {_num(m.get('train/loss'))} kl {_num(m.get('train/kl'))} "
                f"gnorm {_num(m.get('train/grad_norm'))} | queue {m['queue_length']}")

    def eval_line(self, step: int, m: dict[str, Any]) -> str:
        scores = ", ".join(f"{name} " + " ".join(f"{k.rsplit('/', 1)[1]} {v:.3f}" for k, v in m.items()
                                                  if k.startswith(f"eval/{name}/pass@"))
                           for name in self.samplings)
        return f"eval of step {step}: {scores} ({m['eval/seconds']:.1f}s)"

    def summary(self, *, stopped: bool, checkpoint: Path | None, wandb: str | None) -> str:
        """The run's last lines: what it trained, how fast, how the evals went, where things are."""
        ran = self.last_step - self.first_step + 1
        seconds = time.monotonic() - self.started
        head = (f"{self.run_dir.name}: steps {self.first_step}-{self.last_step} of {self.total} in "
                f"{duration(seconds)} ({seconds / ran:.1f} s/step)" if ran > 0 else
                f"{self.run_dir.name}: no step trained")
        if stopped:
            head += f"; stopped on request after step {self.last_step}: the same command resumes from step " \
                    f"{self.last_step + 1}"
        lines = [head, *self._eval_lines()]
        where = [f"metrics.jsonl, {CONFIG_FILE}, timeline/"]
        if (self.run_dir / "eval").is_dir():
            where.append("eval/")
        if checkpoint is not None:
            where.append(f"checkpoints/{checkpoint.name} (hf/: the policy as an HF model)")
        lines.append(f"run directory {self.run_dir}: {', '.join(where)}")
        if wandb:
            lines.append(wandb)
        return "\n  ".join(lines)

    def _eval_lines(self) -> list[str]:
        path = self.run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
        evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
        lines = []
        for name in self.samplings:
            key = f"eval/{name}/pass@1"
            curve = [(r["step"], r[key]) for r in evals if isinstance(r.get(key), (int, float))]
            if len(curve) == 1:
                lines.append(f"eval {name} pass@1: {curve[0][1]:.3f} (step {curve[0][0]})")
            elif curve:
                best = max(curve, key=lambda x: x[1])
                lines.append(f"eval {name} pass@1: {curve[0][1]:.3f} (step {curve[0][0]}) -> {curve[-1][1]:.3f} "
                             f"(step {curve[-1][0]}), best {best[1]:.3f} (step {best[0]})")
        return lines


def _num(value: Any) -> str:
    """Enough digits to see a small loss move, in a fixed width."""
    if not isinstance(value, (int, float)):
        return "-"
    if not math.isfinite(value) or value == 0 or 1e-3 <= abs(value) < 1e4:
        return f"{value:.4f}"
    return f"{value:.3e}"
