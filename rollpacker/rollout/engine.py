"""The rollout engine interface shared by every backend.

Tail batching depends on a few observable behaviours of an engine, and every
backend (the PyTorch reference engine, SGLang, the simulator's modeled engine)
provides exactly these: continuous batching, per-request completion as soon
as a request finishes, abort by id, a KV budget that can preempt, weight
update by HF parameter name, memory release/resume by tag, and live stats.

The interface is poll-driven so that the same scheduler code runs against a
real engine in real time and a modeled engine on a virtual clock: ``poll``
advances the engine (one or more decode steps, or up to the next simulated
event) and returns the requests that finished meanwhile.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from rollpacker.sample import packed

if TYPE_CHECKING:
    import torch

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_EVICTED = "evicted"  # handed back by ``evict`` to continue on another engine

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class RequestError(ValueError):
    """A request the engine refuses; the engine keeps serving the others.

    ``request_ids`` names the refused requests when a batch was partly accepted.
    """

    def __init__(self, message: str, request_ids: Sequence[str] = ()):
        super().__init__(message)
        self.request_ids = tuple(request_ids)

    def __reduce__(self):  # crosses process boundaries (the SGLang engine host) with its request ids
        return type(self), (str(self), self.request_ids)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def with_seed(self, seed: int | None) -> "SamplingParams":
        """These parameters with another seed: made per request, where ``dataclasses.replace`` (which
        rebuilds every field through ``__init__``) was a tenth of rank 0's launch."""
        params = object.__new__(SamplingParams)
        params.__dict__.update(self.__dict__, seed=seed)
        return params

    def validate(self) -> None:
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise RequestError(f"top_k must be -1 or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    """One response to generate.

    ``resume_ids``/``resume_logprobs``: tokens this request already generated
    on another engine before it was evicted (migration by recompute). The
    engine rebuilds their KV and continues; they count towards
    ``max_new_tokens``, are part of the completion's output and consume the
    first draws of the request's seeded sampling stream, so a migrated request
    samples as if it had never moved.

    ``report_progress``: ``RolloutEngine.progress`` will be asked about it (the deterministic race's
    requests); an engine that must stream a request's tokens to count them (SGLang) does so only
    for these.
    """

    request_id: str
    input_ids: Sequence[int]
    params: SamplingParams
    resume_ids: Sequence[int] = ()
    resume_logprobs: Sequence[float] = ()
    report_progress: bool = False

    def resumed_from(self, partial: "Completion") -> "GenerationRequest":
        """This request continued after ``partial`` (an ``evict`` result) on another engine."""
        return dataclasses.replace(self, resume_ids=tuple(partial.output_ids),
                                   resume_logprobs=tuple(partial.logprobs))


@dataclass
class Completion:
    """One finished (or evicted) request. Its tokens are sequences: lists as an in-process engine
    makes them, packed arrays (``array('i')``, ``array('d')``) once the completion crossed a process
    boundary; compare them with ``list(...)``.

    ``routed_experts`` (``RolloutConfig.return_routing`` on a MoE model; empty otherwise, a dense model
    included): the experts the router chose at every position the engine fed through the model for this
    request, i.e. the prompt's tokens and every output token but the last (never fed back), flattened
    from [position, sparse layer (``spec.moe_layers`` order), top-k (descending weight, as ``torch.topk``
    gives)], positions counted from the prompt's first token: ``(len(prompt) + len(output_ids) - 1) *
    len(moe_layers) * experts_per_token`` ints. Each position is written once, when first fed: a
    preempted request's recomputed positions keep their first routing; a migrated request's resumed
    tokens are routed by the engine it resumed on. An evicted request's holds the positions fed on its
    engine so far. A packed ``array('i')`` (in-process too).
    """

    request_id: str
    output_ids: Sequence[int]
    logprobs: Sequence[float]  # log p of each output token under the sampling distribution's model
    finish_reason: str  # FINISH_STOP | FINISH_LENGTH | FINISH_ABORT
    submitted_at: float = 0.0
    finished_at: float = 0.0
    engine_id: int = 0
    routed_experts: Sequence[int] = ()

    def __reduce__(self):
        # Between processes (an engine's server to rank 0) the tokens travel, and stay, packed: a
        # Python object per token, made on unpickling or copying, was the largest cost rank 0 paid
        # per response. Logprobs stay float64, exactly as the engine reported them. Routing too.
        routed = packed("i", self.routed_experts) if len(self.routed_experts) else ()
        return Completion, (self.request_id, packed("i", self.output_ids), packed("d", self.logprobs),
                            self.finish_reason, self.submitted_at, self.finished_at, self.engine_id, routed)



@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    kv_tokens_capacity: int = 0
    preemptions: int = 0
    tokens_generated: int = 0
    extra: dict = field(default_factory=dict)


def request_problem(r: GenerationRequest, active: set[str], vocab_size: int) -> str | None:
    """What makes ``r`` unservable by any in-process engine (None: nothing); ``active``: ids in flight."""
    try:
        r.params.validate()
    except RequestError as exc:
        return str(exc)
    p = r.params
    if r.request_id in active:
        return "a request with this id is already in flight"
    if not r.input_ids:
        return "empty prompt"
    if min(r.input_ids) < 0 or max(r.input_ids) >= vocab_size:
        return f"prompt token ids must be in [0, {vocab_size})"
    if len(r.resume_ids) != len(r.resume_logprobs) or len(r.resume_ids) >= p.max_new_tokens:
        return (f"resumes {len(r.resume_ids)} tokens with {len(r.resume_logprobs)} log-probs; need equal "
                f"counts below max_new_tokens ({p.max_new_tokens})")
    bad = [t for t in p.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        return f"stop token ids {bad} are outside the vocabulary [0, {vocab_size})"
    return None


class RolloutEngine(abc.ABC):
    """One rollout engine (possibly spanning a tensor-parallel group of ranks).

    Two kinds of calls, so that an SPMD program never deadlocks an engine
    against its own collectives:

    - the request plane (``submit``, ``poll``, ``abort``, ``stats``) is called
      on the group's leader only; while the leader serves, the other ranks of
      the group sit in ``serve_follower()`` mirroring its forwards, until the
      leader calls ``stop_followers()`` (or ``shutdown()``);
    - the control plane (``update_weights``, ``release_memory``,
      ``resume_memory``, ``max_weight_diff``) is called by every rank of the
      group together, each with the same full tensors or tags.
    """

    engine_id: int = 0

    @abc.abstractmethod
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue requests. Invalid ones raise ``RequestError`` naming the request."""

    @abc.abstractmethod
    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """Advance the engine and return requests finished since the last poll.

        Aborted requests are not returned. ``timeout`` bounds how long a
        real-time backend may block waiting for a completion.
        """

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop the requests now and free their KV; they never complete."""

    def abort_all(self) -> None:
        self.abort(self.active_request_ids())

    def evict(self, request_ids: Iterable[str]) -> list[Completion]:
        """Stop the requests now and hand them back, one ``Completion`` per id still held:
        a request that already finished (not yet polled) as it is, any other with the
        tokens generated so far and ``finish_reason == FINISH_EVICTED``. Resubmitting
        ``request.resumed_from(partial)`` elsewhere continues it (see ``GenerationRequest``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot hand back running requests")

    def ready_fd(self) -> int | None:
        """A descriptor that turns readable when a request has finished since the last ``poll`` (the
        next ``poll`` reads it empty), so that a server can sleep on its engine beside its sockets
        instead of polling it; None: the engine must be polled (it computes in ``poll``)."""
        return None

    @abc.abstractmethod
    def active_request_ids(self) -> list[str]:
        """Requests submitted and neither finished, polled nor aborted."""

    def progress(self, request_ids: Sequence[str]) -> list[int]:
        """For each active request, how many tokens it had generated when last seen unfinished, so
        its final length is more than that (a finished, unpolled one: one less than its length). A
        count may lag, never lead. The deterministic race reads it to know when no running response
        can still beat a mark; asked only of requests submitted with ``report_progress``."""
        raise NotImplementedError(f"{type(self).__name__} does not report its requests' progress")

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every rank of the group: load full (unsharded) tensors by HF name in place, without restart."""

    def max_weight_diff(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Every rank: the largest |this rank's weights - the given full tensors| (a sync check)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read back its weights")

    def serve_follower(self) -> str:
        """Non-leader ranks: mirror the leader's forwards until it stops them; returns why."""
        return "stop"

    def stop_followers(self) -> None:
        """Leader: end the followers' ``serve_follower`` loop (the request plane goes quiet)."""

    @abc.abstractmethod
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Every rank of the group: free device memory by tag; requires an idle engine."""

    @abc.abstractmethod
    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Every rank of the group: re-allocate what ``release_memory`` freed."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        ...

    def shutdown(self) -> None:
        """Release every resource the engine holds."""
