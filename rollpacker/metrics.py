"""Step metrics (metrics.jsonl + W&B) and the per-step timeline of what every rank did.

Each rank records spans (phase name, start, end) on its own ``Timeline``; at
the end of a step they are gathered to rank 0, which draws one image per step
(one row per rank, one colour per phase) into ``RUN_DIR/timeline/`` and logs
it to W&B beside the step's scalars. Only rank 0 writes anything.

In W&B every metric sits in a section (``SECTIONS``, the prefix before the
first "/"), declared with ``define_metric`` so that the default workspace
groups its charts; metrics.jsonl keeps its flat names, which the tests,
benchmarks and docs read (``wandb_key`` maps one to the other).
"""
from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch.distributed as dist

from rollpacker.checkpoint import append_record, rewind_records

PHASE_COLOURS = {
    "rollout": "#4C72B0", "serve": "#6A8FC8", "follow": "#8FAADC", "reward": "#DD8452", "train": "#55A868",
    "stream_train": "#2E7D32", "sync": "#C44E52", "offload": "#8172B3", "onload": "#937860", "barrier": "#BDBDBD",
    "checkpoint": "#DA8BC3", "idle": "#DDDDDD", "regroup": "#CCB974", "eval": "#17BECF",
}

SECTIONS = ("rollout", "reward", "train", "mismatch", "perf", "eval")
_RENAMED = {"reward_mean": "reward/mean", "accuracy": "reward/accuracy"}
_PERF = {"rollout_s", "reward_s", "bubble_fraction"}


def wandb_key(key: str) -> str:
    """The W&B name of a metrics.jsonl key: keys already in a section keep it; seconds, phase
    changes and weight sync go to ``perf/``; rewards to ``reward/``; the round's counts to ``rollout/``."""
    head = key.split("/", 1)[0]
    if key in _RENAMED:
        return _RENAMED[key]
    if head in SECTIONS:
        return key
    if key in _PERF or head in ("time", "handoff", "sync"):
        return f"perf/{key}"
    return f"rollout/{key}"


@dataclass
class Span:
    rank: int
    phase: str
    start: float
    end: float


@dataclass
class Timeline:
    rank: int
    spans: list[Span] = field(default_factory=list)

    @contextlib.contextmanager
    def span(self, phase: str) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.spans.append(Span(self.rank, phase, start, time.time()))

    def record(self, phase: str, start: float, end: float) -> None:
        self.spans.append(Span(self.rank, phase, start, end))

    def gather(self, group: dist.ProcessGroup | None = None) -> list[Span]:
        """Collective: every rank's spans for the step, on rank 0 (empty elsewhere); resets."""
        mine, self.spans = self.spans, []
        if not dist.is_initialized():
            return mine
        out: list[list[Span]] | None = [None] * dist.get_world_size(group) if self.rank == 0 else None
        dist.gather_object(mine, out, dst=0, group=group)
        return [s for spans in (out or []) for s in spans]


def plot_timeline(spans: list[Span], path: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s.start for s in spans)
    ranks = sorted({s.rank for s in spans})
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.2))
    for s in spans:
        ax.broken_barh([(s.start - t0, max(s.end - s.start, 1e-3))], (s.rank - 0.4, 0.8),
                       color=PHASE_COLOURS.get(s.phase, "#999999"))
    used = sorted({s.phase for s in spans})
    ax.legend(handles=[matplotlib.patches.Patch(color=PHASE_COLOURS.get(p, "#999999"), label=p) for p in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=min(len(used), 6), frameon=False)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    return save_chart(fig, ax, path, title=title, xlabel="seconds since step start")


def save_chart(fig: Any, ax: Any, path: Path, *, title: str, xlabel: str) -> Path:
    """Title, lay out and write a per-step chart (PNG, 90 dpi), and free its figure."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


class MetricsLogger:
    """Writes one JSON line per step, and one per eval (``eval/*`` keys, the step whose weights it
    evaluated), and mirrors them to W&B (offline unless configured)."""

    def __init__(self, run_dir: Path, *, rank: int, wandb_mode: str, project: str, name: str,
                 config: dict[str, Any] | None = None, resume_step: int | None = None):
        self.run_dir, self.rank = Path(run_dir), rank
        self._wandb = None
        self.wandb_where: str | None = None  # for the run's summary: the run's page, or how to upload it
        if rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():  # a resumed run redoes the steps after it
            rewind_records(self.path, resume_step)
        if wandb_mode != "disabled":
            import wandb
            # silent: its banner and its end-of-run history would bury the step lines; the summary
            # says where the run is instead
            self._wandb = wandb.init(project=project, name=name, dir=str(self.run_dir), mode=wandb_mode,
                                     config=config, id=_wandb_id(self.run_dir), resume="allow",
                                     settings=wandb.Settings(silent=True))
            self.wandb_where = (f"W&B run {self._wandb.url}" if wandb_mode == "online" else
                                f"W&B ({wandb_mode}): wandb sync {Path(self._wandb.dir).parent}")
            # every chart's x axis is the training step (an eval line's: the step whose weights it evaluated)
            self._wandb.define_metric("step", hidden=True)
            for section in SECTIONS:
                self._wandb.define_metric(f"{section}/*", step_metric="step")

    def log(self, step: int, metrics: dict[str, Any], images: dict[str, Path] | None = None,
            tables: dict[str, tuple[Sequence[str], list[list]]] | None = None) -> None:
        """``images`` (W&B key: PNG file) and ``tables`` (W&B key: columns, rows) go to W&B only."""
        if self.rank != 0:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        append_record(self.path, record)
        if self._wandb is not None:
            import wandb
            payload = {wandb_key(k): v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            payload["step"] = step
            payload.update({k: wandb.Image(str(path)) for k, path in (images or {}).items()})
            payload.update({k: wandb.Table(columns=list(cols), data=rows)
                            for k, (cols, rows) in (tables or {}).items()})
            self._wandb.log(payload, step=step)

    def steps_with(self, prefix: str) -> set[int]:
        """Steps of the lines (kept after a resume's truncation) that hold a key starting with ``prefix``."""
        if self.rank != 0 or not self.path.exists():
            return set()
        rows = (json.loads(ln) for ln in self.path.read_text().splitlines() if ln)
        return {r["step"] for r in rows if any(k.startswith(prefix) for k in r)}

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_id(run_dir: Path) -> str:
    """A stable W&B run id per run directory, so a resumed job appends to the same run."""
    id_file = run_dir / "wandb_id"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:12])
    return id_file.read_text().strip()


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
