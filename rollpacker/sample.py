"""The one record passed between stages: data -> rollout -> reward -> trainer.

A ``Sample`` is one response to one prompt.  The data pipeline fills the prompt
fields, the rollout engine the response fields, the reward pool the score
fields, and the trainer reads all of them.  ``prompt_uid`` is stable across
epochs and restarts (dataset index), so the prompt ledger can prove that no
prompt is lost or trained twice.
"""
from __future__ import annotations

import array
import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class Prompt:
    """A prompt as served by the data pipeline (one row of the dataset)."""

    uid: int  # stable index of the row in its dataset
    input_ids: list[int]
    data_source: str
    ground_truth: Any = None  # answer string, or a list of code test cases
    extra_info: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0


@dataclass
class Sample:
    prompt: Prompt
    response_index: int  # 0..n-1 among the responses launched for this prompt
    response_ids: Sequence[int] = field(default_factory=list)  # as the engine's completion holds them
    rollout_logprobs: Sequence[float] = field(default_factory=list)
    # a MoE engine's expert choices at every token it fed (``Completion.routed_experts``); empty if none
    routed_experts: Sequence[int] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    # reward
    reward: float | None = None
    correct: bool | None = None
    reward_reason: str | None = None  # "ok", "wrong_answer", "timeout", ...
    # timing, seconds on the scheduler's clock
    submitted_at: float = 0.0
    finished_at: float | None = None
    scored_at: float | None = None
    # filled by the trainer
    advantage: float | None = None

    @property
    def request_id(self) -> str:
        return f"p{self.prompt.uid}e{self.prompt.epoch}r{self.response_index}"

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    def replace(self, **changes: Any) -> "Sample":
        return dataclasses.replace(self, **changes)

    def __reduce__(self):
        # Between processes (an engine's race to rank 0, rank 0 to the trainers) the tokens travel
        # packed: a Python object per token, made on unpickling, was the largest cost rank 0 paid per
        # response. A completion made in another process arrives packed already (``Completion``).
        state = {**self.__dict__, "response_ids": packed("i", self.response_ids),
                 "rollout_logprobs": packed("d", self.rollout_logprobs),
                 "routed_experts": packed("h", self.routed_experts)}
        return _blank_sample, (), state


_PACKED_FIELDS = ("response_index", "response_ids", "rollout_logprobs", "routed_experts", "finish_reason", "reward",
                  "correct", "reward_reason", "submitted_at", "finished_at", "scored_at", "advantage")
_TYPECODES = {"response_ids": "i", "rollout_logprobs": "d", "routed_experts": "h"}  # packed fields


class SampleGroup:
    """One prompt's group of scored responses (GRPO's unit) as it travels: from the engines that raced
    it to the coordinator, on to the trainers. Between processes it crosses packed, its samples as
    bytes with their tokens in arrays, and is unpacked only where its samples are read: the
    coordinator, which forwards groups, makes no object per sample. What the scheduler reads of a
    group travels beside it: its rewards, response lengths and slowest scoring. A group raced in
    parts on several engines is their ``joined`` whole, still packed."""

    def __init__(self, prompt: Prompt | None, samples: list[Sample] | None):
        self._prompt, self._samples = prompt, samples
        self._packed: list[bytes] = []  # the samples' fields, a pickled list per part, while unpacked is None
        self._rewards: tuple = ()
        self._lengths: tuple = ()
        self._slowest_score = 0.0

    @classmethod
    def joined(cls, parts: Sequence["SampleGroup"]) -> "SampleGroup":
        """One group of ``parts`` (each with the prompt or none), in their order, without unpacking them."""
        if all(p._samples is not None for p in parts):
            return cls(parts[0].prompt, [s for p in parts for s in p._samples])
        group = cls(parts[0].prompt, None)
        group._packed = [b for p in parts for b in p._pack()]
        group._rewards = tuple(r for p in parts for r in p.rewards)
        group._lengths = tuple(n for p in parts for n in p.lengths)
        group._slowest_score = max(p.slowest_score for p in parts)
        return group

    @property
    def prompt(self) -> Prompt | None:
        return self._prompt

    @prompt.setter
    def prompt(self, prompt: Prompt) -> None:
        """The coordinator's own prompt (a group crosses to it without one: it launched the prompt)."""
        self._prompt = prompt
        for s in self._samples or ():
            s.prompt = prompt

    @property
    def samples(self) -> list[Sample]:
        if self._samples is None:
            self._samples = [Sample(self._prompt, *fields) for part in self._packed for fields in pickle.loads(part)]
            self._packed = []
        return self._samples

    @property
    def rewards(self) -> tuple[float | None, ...]:
        return tuple(s.reward for s in self._samples) if self._samples is not None else self._rewards

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(len(s.response_ids) for s in self._samples) if self._samples is not None else self._lengths

    @property
    def slowest_score(self) -> float:
        """The longest a response waited for its score, seconds (0 where none was scored)."""
        if self._samples is None:
            return self._slowest_score
        return max(((s.scored_at or 0.0) - (s.finished_at or 0.0) for s in self._samples if s.scored_at is not None),
                   default=0.0)

    def __len__(self) -> int:
        return len(self.lengths)

    def stripped(self) -> "SampleGroup":
        """The same group without its prompt, for the coordinator that launched it."""
        return _unpacked_group(None, self.rewards, self.lengths, self.slowest_score, self._pack())

    def _pack(self) -> list[bytes]:
        if self._samples is None:
            return self._packed
        return [pickle.dumps([tuple(packed(_TYPECODES[f], v) if f in _TYPECODES else v
                                    for f, v in zip(_PACKED_FIELDS, map(s.__dict__.get, _PACKED_FIELDS)))
                              for s in self._samples], pickle.HIGHEST_PROTOCOL)]

    def __reduce__(self):
        return _unpacked_group, (self._prompt, self.rewards, self.lengths, self.slowest_score, self._pack())


def _unpacked_group(prompt: Prompt | None, rewards: tuple, lengths: tuple, slowest_score: float,
                    data: list[bytes]) -> SampleGroup:
    group = SampleGroup(prompt, None)
    group._packed, group._rewards, group._lengths, group._slowest_score = data, rewards, lengths, slowest_score
    return group


def _blank_sample() -> Sample:
    return Sample.__new__(Sample)


def packed(typecode: str, values: Sequence) -> array.array:
    """``values`` as a packed array of ``typecode`` (itself, if it is one already)."""
    return values if isinstance(values, array.array) and values.typecode == typecode else array.array(typecode, values)
