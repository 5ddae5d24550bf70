"""Validation during training: its config section and the metrics of one eval.

The eval itself (which weights, which engines, when) is ``rollpacker.runtime.eval_phase``; this
module holds what needs no engine (and so loads in the preflight): the ``run.eval`` config, the
eval prompts of each file, and the numbers an eval reports from its scored samples, so that an
offline evaluation of an exported checkpoint (``python -m rollpacker.generate`` +
``python -m rollpacker.reward score``) computes the same numbers with the same code.

pass@k is the unbiased estimator of Chen et al. 2021 (arXiv:2107.03374, eq. 1): with n samples of
a prompt of which c are correct, ``1 - C(n-c, k) / C(n, k)``, averaged over prompts. Drawing k of
the n samples without replacement estimates the chance that at least one of k fresh samples is
correct without the bias of ``1 - (1 - c/n)**k``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from rollpacker.configlib import ConfigError
from rollpacker.data.dataset import PromptDataset
from rollpacker.rollout.engine import FINISH_LENGTH

if TYPE_CHECKING:
    from rollpacker.config import Config
    from rollpacker.sample import Prompt


@dataclass
class EvalSampling:
    """One way of sampling the eval prompts; each is reported under ``eval/<name>/``."""

    name: str = "sample"
    n: int = 1  # responses per prompt
    temperature: float | None = None  # None: rollout.temperature; 0 is greedy
    top_p: float | None = None  # None: rollout.top_p
    max_response_length: int | None = None  # None: rollout.max_response_length

    def validate(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"name must be a non-empty string without '/', got {self.name!r}")
        if self.n < 1:
            raise ConfigError(f"n must be >= 1, got {self.n}")
        if self.temperature is not None and self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_response_length is not None and self.max_response_length < 1:
            raise ConfigError(f"max_response_length must be >= 1, got {self.max_response_length}")


@dataclass
class EvalConfig:
    """``run.eval``: evaluate the policy on ``data.eval_files`` while it trains."""

    every: int = 0  # steps between evals; 0: only the one before training (if before_train)
    before_train: bool = True  # evaluate the starting policy (step 0); only where data.eval_files are given
    max_prompts: int = 0  # per eval file, its first N usable rows; 0: all
    seed: int = 0  # base of the eval's sampling seeds (per step, file, prompt and sample)
    samplings: list[EvalSampling] = field(default_factory=lambda: [EvalSampling()])

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"every must be >= 0 (0 = no periodic eval), got {self.every}")
        if self.max_prompts < 0:
            raise ConfigError(f"max_prompts must be >= 0 (0 = every prompt), got {self.max_prompts}")
        if not self.samplings:
            raise ConfigError("samplings must list at least one {name, n, temperature, ...}")
        names = [s.name for s in self.samplings]
        if len(set(names)) != len(names):
            raise ConfigError(f"samplings must have distinct names, got {names}")

    def enabled(self, eval_files: list[str]) -> bool:
        return bool(eval_files) and (self.before_train or self.every > 0)

    def due(self, step: int, last_step: int) -> bool:
        """Whether the weights after ``step`` (0: the starting policy) are evaluated. The final
        step is evaluated too whenever periodic evals are on, so a run ends with its number."""
        if step == 0:
            return self.before_train
        return self.every > 0 and (step % self.every == 0 or step == last_step)


@dataclass(frozen=True)
class EvalRecord:
    """One scored eval response: what the metrics need, and what ``eval/step_*.jsonl`` keeps."""

    sampling: str
    file: str  # the eval file's stem
    data_source: str
    uid: int  # row index in its file
    sample: int
    response_ids: tuple[int, ...]
    finish_reason: str
    reward: float
    correct: bool


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``n`` samples, ``c`` of them correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(records: Iterable[EvalRecord], finished_at: dict[tuple[str, str], float] | None = None
              ) -> dict[str, float]:
    """``eval/<sampling>/<metric>`` over all prompts, and per file (``.../file/<stem>/...``) and per
    data source (``.../source/<name>/...``). ``finished_at``: seconds from the eval's start to the
    last score of each (sampling, group key), reported as ``.../seconds``."""
    groups: dict[tuple[str, str], list[EvalRecord]] = defaultdict(list)
    for r in records:
        for key in ("", f"file/{r.file}/", f"source/{r.data_source}/"):
            groups[(r.sampling, key)].append(r)
    out: dict[str, float] = {}
    for (sampling, key), rs in sorted(groups.items()):
        prefix = f"eval/{sampling}/{key}"
        for name, value in _group_metrics(rs).items():
            out[prefix + name] = value
        if finished_at is not None and (sampling, key) in finished_at:
            out[prefix + "seconds"] = finished_at[(sampling, key)]
    return out


def _group_metrics(records: list[EvalRecord]) -> dict[str, float]:
    by_prompt: dict[tuple[str, int], list[EvalRecord]] = defaultdict(list)
    for r in records:
        by_prompt[(r.file, r.uid)].append(r)
    n = min(len(v) for v in by_prompt.values())  # every prompt has the sampling's n
    lengths = [len(r.response_ids) for r in records]
    out = {
        f"mean@{n}": sum(r.reward for r in records) / len(records),
        "pass@1": _mean(pass_at_k(len(v), sum(r.correct for r in v), 1) for v in by_prompt.values()),
    }
    if n > 1:
        out[f"pass@{n}"] = _mean(pass_at_k(len(v), sum(r.correct for r in v), n) for v in by_prompt.values())
    out.update({"response_len_mean": sum(lengths) / len(lengths), "response_len_max": float(max(lengths)),
                "truncated_frac": sum(r.finish_reason == FINISH_LENGTH for r in records) / len(records),
                "prompts": float(len(by_prompt)), "samples": float(len(records))})
    return out


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


def file_key(path: str) -> str:
    """How an eval file is named in metric keys: its stem (``assets/data/eval.jsonl`` -> ``eval``)."""
    return Path(path).stem


def eval_prompts(cfg: Config, tokenizer: Any) -> list[tuple[str, list[Prompt]]]:
    """(file key, prompts) per eval file: its first ``max_prompts`` usable rows, in file order.
    Bad rows are skipped and counted as in training; a file without usable rows raises."""
    out = []
    cap = cfg.run.eval.max_prompts
    for path in cfg.data.eval_files:
        data = PromptDataset([path], tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                             apply_chat_template=cfg.data.apply_chat_template, shuffle=False)
        out.append((file_key(path), data.take(min(cap, len(data)) if cap else len(data))))
    return out


def check_eval_files(cfg: Config) -> None:
    """Metric keys name a file by its stem: two eval files with one stem would share keys."""
    keys = [file_key(p) for p in cfg.data.eval_files]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ValueError(f"data.eval_files: files named {dup} more than once (eval metrics are keyed by file "
                         "name without extension); rename or copy one of them")
