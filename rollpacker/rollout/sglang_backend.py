"""SGLang rollout backend: the same ``RolloutEngine`` interface over ``sglang.Engine`` (pinned 0.5.23).

The first rank of each rollout TP group owns one ``sglang.Engine`` with
``tp_size`` = the group size and ``base_gpu_id`` = that rank's local GPU; SGLang
starts its own TP worker processes on the group's GPUs, so the other ranks of
the group have nothing to drive. Each engine owns a block of ports chosen by
(node-local rank, TP size) so that no two engines on a node share one, whichever
TP sets a rank leads (``engine_ports``). With ``device="cpu"`` the engine runs sglang's
plain-torch CPU path instead (``sglang_args.server_args``, ``cpu_engine_env``).

Requests go through ``Engine.async_generate`` on the engine's own event loop,
run by a background thread while requests are in flight; each result lands in
a thread-safe queue that ``poll`` drains. Control calls (memory release/resume,
weight update) are SGLang's synchronous methods, which drive that same loop
with ``run_until_complete``, so the background thread is paused around them.

Weights are pushed inside one ``begin_weight_update()`` / ``end_weight_update()`` session: 0.5.23
refuses ``update_weights_from_tensor`` outside it and says so only in its ``(success, message)``
return, so every such return is checked and a refusal raises ``WeightSyncError``.

Memory is released or resumed only on an idle engine: sglang's scheduler asserts ``is_fully_idle()``
in ``release_memory_occupation`` and SIGQUITs the whole rank if it is not, and an aborted request
stays in its running batch until the next forward. So ``release_memory``/``resume_memory`` first
wait (bounded by ``drain_timeout_s``) until every request sent to sglang, aborted ones included,
has come back and the scheduler's load snapshot shows nothing running or waiting.

``stats()`` reports the engine's own numbers: KV capacity is the scheduler's
``max_total_num_tokens`` (from ``get_server_info``); running, waiting and KV tokens in use come
from the load snapshot the scheduler publishes (``TokenizerManager.get_loads``), refreshed at
every prefill, every ``load_snapshot_publish_interval`` (15) decode steps, and when it goes idle.

Seeds: sglang 0.5.23 reads ``sampling_seed`` only when ``enable_deterministic_inference`` is on
(``sampling/sampling_batch_info.py``, ``SamplingBatchInfo.from_schedule_batch``: the seed tensor
is built ``if enable_deterministic`` and is None otherwise), and ``server_args`` does not turn it
on (with it, the flashinfer sampler asserts on any top-p/top-k request, ``layers/sampler.py``).
So a request's seed is passed through but guarantees nothing here: the same seeded request can
give a different sample on a rerun, after a migration or on another engine. Only greedy
(temperature 0) output is reproducible, up to batch-dependent numerics.

Semantics matched to the reference engine:
- log-probs are of the temperature-1 model distribution
  (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, inherited by SGLang's subprocesses);
- a request with no stop ids runs to ``max_new_tokens`` (``ignore_eos``);
  SGLang otherwise also stops at the model's EOS, which callers pass as a stop id;
- output tokens and log-probs both come from ``output_token_logprobs``, so they
  are aligned by construction; preemptions are SGLang's ``num_retractions``.

Every SGLang call goes through ``_SGLangCalls``, which refuses any method or
keyword missing from ``SGLANG_API``; ``tests/test_sglang_backend.py`` checks that
table against the source of the pinned wheel.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import (FINISH_ABORT, FINISH_EVICTED, MEMORY_TAGS, Completion, EngineStats, GenerationRequest,
                                       RequestError, RolloutEngine, SamplingParams)
from rollpacker.rollout.sglang_args import cpu_engine_env, server_args

SGLANG_VERSION = "0.5.23"
# torchrun's c10d rendezvous sets this in its workers; see ``_engine_process_env``.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
LOAD_TIMEOUT_S = 30.0  # one load-snapshot read (a shared-memory read on the engine's loop)

# The whole SGLang surface this backend touches: "Class.method" -> keywords it passes.
# ``Engine.__init__`` keywords are ServerArgs fields.
SGLANG_API: dict[str, tuple[str, ...]] = {
    "Engine.__init__": ("model_path", "tp_size", "base_gpu_id", "port", "nccl_port", "enable_memory_saver",
                        "mem_fraction_static", "max_running_requests", "skip_tokenizer_init", "random_seed",
                        # a CPU engine (``sglang_args.server_args``)
                        "device", "attention_backend", "sampling_backend", "disable_cuda_graph",
                        "max_total_tokens", "dtype", "skip_server_warmup"),
    "Engine.get_server_info": (),
    "Engine.async_generate": ("input_ids", "sampling_params", "return_logprob", "rid"),
    "Engine.release_memory_occupation": ("tags",),
    "Engine.resume_memory_occupation": ("tags",),
    "Engine.begin_weight_update": (),
    "Engine.update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
    "Engine.end_weight_update": (),
    "Engine.shutdown": (),
    "TokenizerManager.abort_request": ("rid", "abort_all"),
    "TokenizerManager.get_loads": (),
}
SGLANG_ENGINE_ATTRIBUTES = ("loop", "tokenizer_manager")  # set by Engine.__init__
SGLANG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "sampling_seed",
                        "ignore_eos")
SGLANG_OUTPUT_KEYS = ("meta_info", "finish_reason", "output_token_logprobs", "num_retractions")
SGLANG_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


class WeightSyncError(RuntimeError):
    """SGLang refused part of a weight push: the engine must not serve rollouts from what it holds."""


def sampling_params(p: SamplingParams) -> dict[str, Any]:
    """sglang's sampling parameters; the seed is passed on but sglang ignores it here (module docstring)."""
    out = dict(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_new_tokens=p.max_new_tokens,
               stop_token_ids=list(p.stop_token_ids), ignore_eos=not p.stop_token_ids)
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


def completion(request_id: str, output: dict, submitted_at: float, engine_id: int) -> Completion:
    """Translate one ``async_generate`` result (``return_logprob=True``) into a ``Completion``."""
    meta = output["meta_info"]
    triples = meta["output_token_logprobs"]  # (logprob, token id, text or None) per output token
    return Completion(request_id=request_id, output_ids=[int(t) for _, t, _ in triples],
                      logprobs=[float(lp) for lp, _, _ in triples], finish_reason=meta["finish_reason"]["type"],
                      submitted_at=submitted_at, finished_at=time.monotonic(), engine_id=engine_id)


def weight_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                   limit_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``limit_bytes`` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class _SGLangCalls:
    """The only door to the SGLang engine: refuses calls outside ``SGLANG_API``."""

    def __init__(self, engine: Any):
        self.engine = engine

    @staticmethod
    def check(qualname: str, kwargs: dict[str, Any]) -> None:
        allowed = SGLANG_API.get(qualname)
        if allowed is None or set(kwargs) - set(allowed):
            raise AssertionError(f"{qualname}({', '.join(kwargs)}) is not in SGLANG_API; add it there so the "
                                 f"contract test checks it against sglang=={SGLANG_VERSION}")

    def __call__(self, qualname: str, **kwargs: Any) -> Any:
        self.check(qualname, kwargs)
        owner, method = qualname.split(".")
        target = self.engine.tokenizer_manager if owner == "TokenizerManager" else self.engine
        return getattr(target, method)(**kwargs)


class _LoopThread:
    """Runs an asyncio loop in a background thread, and can pause it for synchronous callers."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sglang-loop", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        if self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self._thread = None

    def run(self, coro) -> concurrent.futures.Future:
        self.start()
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop's thread (SGLang's objects are not thread-safe) and wait for it."""
        async def on_loop() -> Any:
            return fn()
        return self.run(on_loop()).result()


@contextlib.contextmanager
def _engine_process_env(extra: dict[str, str]) -> Iterator[None]:
    """Hide ``TORCHELASTIC_USE_AGENT_STORE`` while sglang spawns its processes (review C2), and set
    ``extra`` (``cpu_engine_env``) meanwhile.

    torchrun's c10d rendezvous sets it to True in every worker. The schedulers inherit it, and their
    ``init_process_group("tcp://127.0.0.1:<nccl_port>")`` then only creates ``TCPStore`` clients
    (``torch/distributed/rendezvous.py``, ``_create_c10d_store``): nobody serves the port, so they
    wait for the store until its timeout and the engine never starts. sglang 0.5.23 never touches
    the variable. It is put back afterwards: the trainer's own process groups rely on it.
    """
    saved = {k: os.environ.get(k) for k in (AGENT_STORE_ENV, *extra)}
    os.environ.pop(AGENT_STORE_ENV, None)
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class _Failure:
    request_id: str
    error: BaseException


class SGLangEngine(RolloutEngine):
    """``RolloutEngine`` over ``sglang.Engine``; constructed on every rank of ``group``.

    ``engine_cls`` replaces ``sglang.Engine`` (tests inject a recording double). ``device``
    ``"cuda:N"`` pins the leader's GPU, ``"cuda"`` takes ``LOCAL_RANK``'s; ``"cpu"`` runs the
    engine on CPU (``sglang_args.server_args``).
    """

    def __init__(self, model_dir: str | Path, cfg: RolloutConfig, *, group: dist.ProcessGroup | None = None,
                 engine_id: int = 0, device: str = "cuda", engine_cls: Callable | None = None):
        cfg.validate()
        self.cfg, self.engine_id = cfg, engine_id
        if group is None:
            ranks = [dist.get_rank() if dist.is_initialized() else 0]
        else:
            ranks = dist.get_process_group_ranks(group)
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            raise ValueError(f"engine {engine_id}: an SGLang TP group must be consecutive ranks on one node "
                             f"(its GPUs are base_gpu_id..base_gpu_id+tp-1), got ranks {ranks}")
        self.is_leader = group is None or dist.get_rank(group) == 0
        self._stats = EngineStats()
        self._active: dict[str, float] = {}  # request id -> submitted_at
        self._aborted: set[str] = set()
        self._evicting: set[str] = set()
        self._resumed: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {}  # continuation prefixes
        self._results: queue.Queue[Completion | _Failure] = queue.Queue()
        # Requests sent to sglang whose result has not come back yet, aborted ones included: sglang
        # holds them (and so is not idle) until then. Changed on the loop thread, waited on by callers.
        self._in_sglang: set[str] = set()
        self._returned = threading.Condition()
        self._busy_since: float | None = None
        if not self.is_leader:
            return
        if engine_cls is None:
            import sglang  # only here: the backend is selected and this rank owns the engine
            engine_cls = sglang.Engine
        os.environ.update(SGLANG_ENV)
        dev = torch.device(device)
        local_rank = int(os.environ.get("LOCAL_RANK", ranks[0]))
        gpu = None if dev.type == "cpu" else dev.index if dev.index is not None else local_rank
        kwargs = server_args(model_dir, cfg, tp_size=len(ranks), local_rank=local_rank, gpu_id=gpu,
                             engine_id=engine_id, device=dev)
        _SGLangCalls.check("Engine.__init__", kwargs)
        with _engine_process_env(cpu_engine_env(len(ranks)) if dev.type == "cpu" else {}):
            self._engine = engine_cls(**kwargs)
        self._call = _SGLangCalls(self._engine)
        self._loop = _LoopThread(self._engine.loop)
        # Fixed at startup (the scheduler sizes its pool once): the token capacity the stream
        # trainer's hand-off weighs the projected KV demand against.
        self._kv_capacity = int(self._call("Engine.get_server_info")["max_total_num_tokens"])

    # ---- interface -----------------------------------------------------------------------------
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        self._require_leader()
        errors, refused = [], []
        for r in requests:
            problem = self._problem(r)
            if problem:
                errors.append(f"request {r.request_id!r}: {problem}")
                refused.append(r.request_id)
                continue
            self._active[r.request_id] = time.monotonic()
            with self._returned:
                self._in_sglang.add(r.request_id)
            self._loop.run(self._generate(r, self._active[r.request_id]))
        if self._active and self._busy_since is None:
            self._busy_since = time.monotonic()
        if errors:
            raise RequestError("; ".join(errors), refused)

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """Wait up to ``timeout`` (None: until one finishes) for a completion, then drain the rest."""
        self._require_leader()
        done: list[Completion] = []
        failures: list[_Failure] = []
        block = bool(self._active)
        while True:
            try:
                item = self._results.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                break
            block = False
            if item.request_id in self._aborted:
                self._aborted.discard(item.request_id)
            elif isinstance(item, _Failure):
                failures.append(item)
                self._active.pop(item.request_id, None)
            else:
                done.append(item)
                self._active.pop(item.request_id, None)
                self._stats.tokens_generated += len(item.output_ids)
        self._update_busy()
        if failures:  # the completions are not lost: they come back with the next poll
            for c in done:
                self._results.put(c)
            raise RequestError("; ".join(f"request {f.request_id!r}: sglang failed it: {f.error!r}"
                                         for f in failures), [f.request_id for f in failures])
        return done

    def abort(self, request_ids: Iterable[str]) -> None:
        self._require_leader()
        for rid in [r for r in request_ids if r in self._active]:
            del self._active[rid]
            self._aborted.add(rid)
            self._loop.call(lambda rid=rid: self._call("TokenizerManager.abort_request", rid=rid, abort_all=False))
        self._update_busy()

    def abort_all(self) -> None:
        self._require_leader()
        if self._active:
            self._aborted.update(self._active)
            self._active.clear()
            self._loop.call(lambda: self._call("TokenizerManager.abort_request", rid="", abort_all=True))
        self._update_busy()

    def evict(self, request_ids: Iterable[str], timeout_s: float = 60.0) -> list[Completion]:
        """Abort the requests and collect what SGLang returns for each: the output so far
        (finish reason "abort"), or the whole output of one that finished meanwhile."""
        self._require_leader()
        ids = [rid for rid in request_ids if rid in self._active]
        for rid in ids:
            self._evicting.add(rid)
            self._loop.call(lambda rid=rid: self._call("TokenizerManager.abort_request", rid=rid, abort_all=False))
        handed: list[Completion] = []
        others: list[Completion | _Failure] = []
        deadline = time.monotonic() + timeout_s
        try:
            while len(handed) < len(ids):
                item = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
                if item.request_id not in self._evicting:
                    others.append(item)
                    continue
                self._evicting.discard(item.request_id)
                submitted_at = self._active.pop(item.request_id)
                if isinstance(item, _Failure):  # nothing came back: only what it resumed from survives
                    prefix_ids, prefix_lps = self._resumed.pop(item.request_id, ((), ()))
                    item = Completion(item.request_id, list(prefix_ids), list(prefix_lps), FINISH_EVICTED,
                                      submitted_at, time.monotonic(), self.engine_id)
                handed.append(item)
        except queue.Empty:
            raise TimeoutError(f"engine {self.engine_id}: SGLang did not return evicted requests "
                               f"{sorted(self._evicting)} within {timeout_s}s") from None
        finally:
            for item in others:
                self._results.put(item)
        self._update_busy()
        return handed

    def active_request_ids(self) -> list[str]:
        return list(self._active)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push full HF tensors in buckets of at most ``weight_bucket_mb``, inside one weight-update
        session; the last bucket flushes the cache. Raises ``WeightSyncError`` if SGLang refuses any step.

        Other ranks of the group own no engine: their call only walks the tensors."""
        if not self.is_leader:
            for _ in named_tensors:
                pass
            return
        limit = self.cfg.weight_bucket_mb << 20
        with self._paused(), self._weight_update_session():
            pending = None
            for bucket in weight_buckets(named_tensors, limit):
                if pending is not None:
                    self._push(pending, flush_cache=False)
                pending = bucket
            if pending is not None:
                self._push(pending, flush_cache=True)

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Release once the engine is idle (aborted requests drained): see ``wait_idle``."""
        self._memory("Engine.release_memory_occupation", tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._memory("Engine.resume_memory_occupation", tags)

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until sglang holds none of our requests: every one sent has come back (an aborted
        request ends only after the scheduler's next forward) and the scheduler's load snapshot
        shows nothing running or waiting. Raises ``TimeoutError`` after ``cfg.drain_timeout_s``."""
        self._require_leader()
        timeout_s = self.cfg.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._returned:
            if self._in_sglang:
                self._loop.start()  # the results come back through the loop
            if not self._returned.wait_for(lambda: not self._in_sglang, timeout=timeout_s):
                raise TimeoutError(f"engine {self.engine_id}: sglang has not returned requests "
                                   f"{sorted(self._in_sglang)[:8]} ({len(self._in_sglang)} in all) "
                                   f"{timeout_s}s after they were sent or aborted")
        # A result reaches us before the scheduler has dropped the finished batch; it publishes a
        # fresh snapshot on going idle.
        while (load := self._engine_load()) is not None and (load.num_running_reqs or load.num_waiting_reqs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id}: sglang still reports {load.num_running_reqs} "
                                   f"running and {load.num_waiting_reqs} waiting requests {timeout_s}s "
                                   f"after all of ours came back")
            time.sleep(0.01)

    def stats(self) -> EngineStats:
        """The engine's own load (running, waiting, KV tokens in use, of ``max_total_num_tokens``);
        preemptions = retractions. ``extra["in_flight"]`` counts requests not yet returned to us."""
        busy = self._stats.busy_seconds + (time.monotonic() - self._busy_since if self._busy_since else 0.0)
        load = self._engine_load() if self.is_leader else None
        return EngineStats(running=load.num_running_reqs if load else len(self._active),
                           waiting=load.num_waiting_reqs if load else 0,
                           kv_tokens_used=load.num_used_tokens if load else 0,
                           kv_tokens_capacity=self._kv_capacity if self.is_leader else 0,
                           preemptions=self._stats.preemptions, tokens_generated=self._stats.tokens_generated,
                           busy_seconds=busy, extra={"backend": "sglang", "in_flight": len(self._active),
                                                     "load_snapshot": load is not None})

    def shutdown(self) -> None:
        if self.is_leader:
            self.abort_all()
            with self._paused():
                self._call("Engine.shutdown")

    def serve_follower(self) -> str:
        """Nothing to mirror: SGLang drives the group's GPUs from the leader's engine."""
        return "stop"

    # ---- internals -----------------------------------------------------------------------------
    def _require_leader(self) -> None:
        if not self.is_leader:
            raise RuntimeError("engine methods are called on the TP group's leader")

    def _problem(self, r: GenerationRequest) -> str | None:
        try:
            r.params.validate()
        except RequestError as exc:
            return str(exc)
        if not r.input_ids:
            return "empty prompt"
        if len(r.resume_ids) != len(r.resume_logprobs) or len(r.resume_ids) >= r.params.max_new_tokens:
            return (f"resumes {len(r.resume_ids)} tokens with {len(r.resume_logprobs)} log-probs; need equal "
                    f"counts below max_new_tokens ({r.params.max_new_tokens})")
        if r.request_id in self._active:
            return "a request with this id is already in flight"
        return None

    async def _generate(self, r: GenerationRequest, submitted_at: float) -> None:
        # A resumed request is a continuation: its tokens so far join the prompt (SGLang rebuilds
        # their KV by prefill) and are put back in front of the output. The rest of the response is
        # a fresh sample (SGLang ignores the seed, see the module docstring), equally valid but not
        # the one the unmigrated request would have given, unlike the reference engine.
        if r.resume_ids:
            self._resumed[r.request_id] = (tuple(r.resume_ids), tuple(r.resume_logprobs))
        params = dataclasses.replace(r.params, max_new_tokens=r.params.max_new_tokens - len(r.resume_ids))
        try:
            out = await self._call("Engine.async_generate", input_ids=[*r.input_ids, *r.resume_ids],
                                   sampling_params=sampling_params(params), return_logprob=True,
                                   rid=r.request_id)
            c = completion(r.request_id, out, submitted_at, self.engine_id)
            prefix_ids, prefix_lps = self._resumed.pop(r.request_id, ((), ()))
            c.output_ids, c.logprobs = [*prefix_ids, *c.output_ids], [*prefix_lps, *c.logprobs]
            self._stats.preemptions += int(out["meta_info"].get("num_retractions", 0))
            if c.finish_reason == FINISH_ABORT and r.request_id in self._evicting:
                c.finish_reason = FINISH_EVICTED
                self._results.put(c)
            else:
                self._results.put(_Failure(r.request_id, RuntimeError("aborted by SGLang"))
                                  if c.finish_reason == FINISH_ABORT else c)
        except Exception as exc:  # an aborted request may end in an exception; poll sorts it out
            self._results.put(_Failure(r.request_id, exc))
        finally:
            with self._returned:
                self._in_sglang.discard(r.request_id)
                self._returned.notify_all()

    def _engine_load(self) -> Any:
        """The scheduler's latest load snapshot, or None if it publishes none."""
        loads = self._loop.run(self._call("TokenizerManager.get_loads")).result(timeout=LOAD_TIMEOUT_S)
        return loads[0] if loads else None

    def _update_busy(self) -> None:
        now = time.monotonic()
        if not self._active and self._busy_since is not None:
            self._stats.busy_seconds += now - self._busy_since
            self._busy_since = None

    def _memory(self, qualname: str, tags: Sequence[str]) -> None:
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)}; valid: {MEMORY_TAGS}")
        if not self.is_leader:  # the owner's engine releases the whole group's GPUs
            return
        if self._active:
            raise RuntimeError(f"engine {self.engine_id}: {qualname.split('.')[1]} needs an idle engine "
                               f"({len(self._active)} requests in flight)")
        self.wait_idle()
        with self._paused():
            self._call(qualname, tags=list(tags))

    def _push(self, bucket: list[tuple[str, torch.Tensor]], *, flush_cache: bool) -> None:
        self._checked("Engine.update_weights_from_tensor",
                      f"tensors {[name for name, _ in bucket]}",
                      named_tensors=bucket, load_format=None, flush_cache=flush_cache)

    def _checked(self, qualname: str, subject: str, **kwargs: Any) -> None:
        """Call a control method that answers ``(success, message)`` and raise unless it succeeded."""
        result = self._call(qualname, **kwargs)
        ok, message = result if isinstance(result, tuple) and len(result) == 2 else (False, repr(result))
        if not ok:
            raise WeightSyncError(f"engine {self.engine_id}: sglang refused {qualname.split('.')[1]} "
                                  f"({subject}): {message}")

    @contextlib.contextmanager
    def _weight_update_session(self) -> Iterator[None]:
        self._checked("Engine.begin_weight_update", "opening the weight-update session")
        try:
            yield
        except BaseException:
            # Close the session: one left open makes the next begin_weight_update fail ("a
            # weight-update session is already open"), so every later sync would be refused too.
            # The push's error is the one to report; a failure to close is not raised over it.
            with contextlib.suppress(Exception):
                self._call("Engine.end_weight_update")
            raise
        self._checked("Engine.end_weight_update", "closing the weight-update session")

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """SGLang's synchronous methods run its loop themselves: stop the background thread meanwhile."""
        self._loop.pause()
        try:
            yield
        finally:
            if self._active:
                self._loop.start()
