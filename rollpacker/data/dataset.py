"""Prompt data pipeline: verl-style JSONL/Parquet rows -> tokenized ``Prompt`` records.

Row schema (what RL users already have)::

    {"prompt": [{"role": "user", "content": "..."}] | "plain text",
     "data_source": "gsm8k",
     "reward_model": {"ground_truth": "42" | [test cases], "style": "rule"},
     "extra_info": {...}}                      # optional; may carry "tests"

Every usable row is tokenized once at construction (the chat template of the
tokenizer applied unless disabled) so that over-long prompts are known before
training starts.  Rows that cannot be served are skipped and counted per
reason, and one warning summarises them.  Serving order is a per-epoch
permutation seeded by ``seed + epoch``, so a position (epoch, offset) is all
that a checkpoint needs to resume exactly.
"""
from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from rollpacker.data.config import DataConfig
from rollpacker.sample import Prompt

logger = logging.getLogger(__name__)

# Why a row was skipped.
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
EMPTY_PROMPT = "empty_prompt"
TOO_LONG = "too_long"
UNDECODABLE = "undecodable"  # invalid UTF-8 or a line that is not JSON


class BadRow(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class _Row:
    uid: int
    where: str  # "file:line" or "file:row", for messages
    messages: list[dict[str, str]] | None
    text: str | None
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                yield where, BadRow(UNDECODABLE, str(exc))


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's errors do not always name the file
        raise ValueError(f"data file {path}: cannot read it as Parquet: {exc}") from None
    for index, row in enumerate(table.to_pylist()):
        yield f"{path}:row {index}", row


def _read_rows(path: Path) -> Iterator[tuple[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise ValueError(f"data file {path}: unsupported format {path.suffix!r} (use .jsonl or .parquet)")


def _text(value: Any, field: str) -> str:
    if isinstance(value, bytes):  # Parquet binary columns
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRow(UNDECODABLE, f"{field}: {exc}") from None
    if not isinstance(value, str):
        raise BadRow(WRONG_TYPE, f"{field} must be a string, got {type(value).__name__}")
    return value


def _parse(uid: int, where: str, row: Any) -> _Row:
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(WRONG_TYPE, f"row must be an object, got {type(row).__name__}")
    for key in ("prompt", "data_source"):
        if row.get(key) is None:
            raise BadRow(MISSING_FIELD, f"no {key!r}")
    extra_info = {} if row.get("extra_info") is None else row["extra_info"]
    if not isinstance(extra_info, dict):
        raise BadRow(WRONG_TYPE, f"extra_info must be an object, got {type(extra_info).__name__}")
    reward_model = row.get("reward_model")
    if reward_model is not None and not isinstance(reward_model, dict):
        raise BadRow(WRONG_TYPE, f"reward_model must be an object, got {type(reward_model).__name__}")
    # Code datasets may keep their test cases in extra_info instead.
    ground_truth = (reward_model or {}).get("ground_truth")
    if ground_truth is None:
        ground_truth = extra_info.get("tests")
    if ground_truth is None:
        raise BadRow(MISSING_FIELD, "no reward_model.ground_truth (nor extra_info.tests)")
    if isinstance(ground_truth, bytes):
        ground_truth = _text(ground_truth, "reward_model.ground_truth")

    prompt = row["prompt"]
    messages, text = None, None
    if isinstance(prompt, (str, bytes)):
        text = _text(prompt, "prompt")
        empty = not text.strip()
    elif isinstance(prompt, list):
        messages = []
        for i, message in enumerate(prompt):
            if not isinstance(message, dict) or message.get("role") is None or message.get("content") is None:
                raise BadRow(WRONG_TYPE, f"prompt[{i}] must be a {{role, content}} message")
            messages.append({"role": _text(message["role"], f"prompt[{i}].role"),
                             "content": _text(message["content"], f"prompt[{i}].content")})
        empty = not any(m["content"].strip() for m in messages)
    else:
        raise BadRow(WRONG_TYPE, f"prompt must be a string or a list of messages, got {type(prompt).__name__}")
    if empty:
        raise BadRow(EMPTY_PROMPT, "prompt has no text")
    return _Row(uid=uid, where=where, messages=messages, text=text,
                data_source=_text(row["data_source"], "data_source"), ground_truth=ground_truth,
                extra_info=extra_info)


class PromptDataset:
    """Tokenized prompts from JSONL/Parquet files, served in seeded per-epoch order.

    ``Prompt.uid`` is the row's index over the concatenated files (blank JSONL
    lines aside, skipped rows included), so it does not move when the filter
    settings change.
    """

    def __init__(self, files: list[str], tokenizer, *, max_prompt_length: int,
                 apply_chat_template: bool = True, shuffle: bool = True, seed: int = 1):
        if not files:
            raise ValueError("PromptDataset needs at least one data file")
        self.files = [str(f) for f in files]
        self.max_prompt_length = max_prompt_length
        self.shuffle = shuffle
        self.seed = seed
        self.skipped: dict[str, int] = {}
        self._prompts: list[Prompt] = []
        first_skip: dict[str, str] = {}
        uid = 0
        for file in self.files:
            rows: list[_Row] = []
            for where, raw in _read_rows(Path(file)):
                try:
                    rows.append(_parse(uid, where, raw))
                except BadRow as bad:
                    self._skip(bad.reason, f"{where}: {bad}", first_skip)
                uid += 1
            usable_before = len(self._prompts)
            for row, ids in zip(rows, self._tokenize(rows, tokenizer, apply_chat_template)):
                if len(ids) > max_prompt_length:
                    self._skip(TOO_LONG, f"{row.where}: {len(ids)} tokens > max_prompt_length "
                                         f"{max_prompt_length}", first_skip)
                    continue
                self._prompts.append(Prompt(uid=row.uid, input_ids=ids, data_source=row.data_source,
                                            ground_truth=row.ground_truth, extra_info=row.extra_info))
            if len(self._prompts) == usable_before:
                raise ValueError(f"data file {file} has no usable rows (skipped so far: {self.skipped})")
        if self.skipped:
            logger.warning("skipped %d of %d rows in %s: %s; first of each: %s",
                           sum(self.skipped.values()), uid, ", ".join(self.files), self.skipped,
                           "; ".join(first_skip.values()))
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer, *, split: str = "train") -> "PromptDataset":
        """The train split (shuffled as configured) or the eval split (fixed order)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        files = cfg.train_files if split == "train" else cfg.eval_files
        return cls(files, tokenizer, max_prompt_length=cfg.max_prompt_length,
                   apply_chat_template=cfg.apply_chat_template,
                   shuffle=cfg.shuffle and split == "train", seed=cfg.seed)

    def _skip(self, reason: str, detail: str, first_skip: dict[str, str]) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        first_skip.setdefault(reason, f"{reason} at {detail}")

    @staticmethod
    def _tokenize(rows: list[_Row], tokenizer, apply_chat_template: bool) -> list[list[int]]:
        if apply_chat_template:
            texts = [tokenizer.apply_chat_template(
                row.messages or [{"role": "user", "content": row.text}],
                add_generation_prompt=True, tokenize=False) for row in rows]
            # The template already holds every special token the model expects.
            return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        texts = [row.text if row.text is not None else "\n".join(m["content"] for m in row.messages)
                 for row in rows]
        return tokenizer(texts)["input_ids"] if texts else []

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self._prompts)

    def data_sources(self) -> Counter[str]:
        """How many usable prompts name each ``data_source``."""
        return Counter(p.data_source for p in self._prompts)

    @property
    def epoch(self) -> int:
        return self._epoch

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts, moving into the next epoch (a new order) when this one ends."""
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0, got {n}")
        out = []
        for _ in range(n):
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
            base = self._prompts[self._order[self._position]]
            out.append(Prompt(uid=base.uid, input_ids=list(base.input_ids), data_source=base.data_source,
                              ground_truth=base.ground_truth, extra_info=dict(base.extra_info),
                              epoch=self._epoch))
            self._position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position, "num_prompts": len(self), "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position; refuses a state saved over different data or seed."""
        if state.get("num_prompts") != len(self) or state.get("seed") != self.seed:
            raise ValueError(f"dataset state was saved for {state.get('num_prompts')} prompts with seed "
                             f"{state.get('seed')}, this dataset has {len(self)} with seed {self.seed}")
        if not 0 <= state["position"] <= len(self):
            raise ValueError(f"dataset state position {state['position']} is outside 0..{len(self)}")
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._order = self._epoch_order(self._epoch)
