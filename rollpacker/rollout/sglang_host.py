"""The engine host: one ``sglang.Engine`` in an OS process of its own, driven by ``SGLangEngine``.

Why a process per engine (sglang 0.5.17 and 0.5.23 alike unless said otherwise):
- 0.5.23 keeps one live config per process ("a process holds at most one live config",
  ``runtime_context.py``; ``Engine.__init__`` publishes its own), so a rank leading engines of
  two TP sizes in one process serialised weights for the wrong TP size
  (``SGLangSurface.process_wide_config``), and every ``Engine`` of a process shares the main
  thread's event loop;
- the first ``TokenizerManager`` call on a main thread installs loop handlers for SIGTERM and
  SIGQUIT (``tokenizer_manager.py``, ``auto_create_handle_loop``: 0.5.17 line 2163, 0.5.23 line
  2455) whose watchdog exits the process: in the rank process that ended the run before our
  end-of-step checkpoint;
- ``Engine.shutdown`` kills every child of its process (``kill_process_tree(os.getpid(),
  include_parent=False)``, ``entrypoints/engine.py``: 0.5.17 line 1230, 0.5.23 line 1491): in the
  rank process that took the reward workers with it.

The host is started by the rank in a new session, so its process group is the host plus the
scheduler and detokenizer processes sglang spawns; the rank kills that group, and nothing else,
when it is done with the engine. The host ignores SIGTERM (a Slurm job's SIGTERM reaches every
process of the step; the rank decides when the engine ends) and exits when its connection to the
rank closes, or with its whole group when one of sglang's processes dies, so that the rank sees
an error instead of waiting for results that will never come.

Inside the host, ``SGLangDriver`` translates our ``RolloutEngine`` calls to sglang's: requests go
through ``Engine.async_generate`` on the engine's event loop, which one thread runs for the engine's
whole life; each result lands in a queue that ``poll`` drains. Control calls (memory, weights) are
sglang's synchronous methods, which drive that same loop with ``run_until_complete``: that thread
runs them while the loop is stopped (``_LoopThread``). What differs between
the supported sglang releases comes from the host's ``SGLangSurface`` (``sglang_api``), read from
the installed distribution before sglang is imported; an unsupported release ends the start.

Usage (by ``SGLangEngine``, not by hand): ``python -m rollpacker.rollout.sglang_host SOCKET``
with the connection key in ``ROLLPACKER_HOST_KEY``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import (FINISH_ABORT, FINISH_EVICTED, MEMORY_TAGS, Completion, EngineStats,
                                       GenerationRequest, RequestError)
from rollpacker.rollout.sglang_api import (LOAD_TIMEOUT_S, SGLangCalls, SGLangSurface, WeightSyncError, check_call,
                                           completion, installed_surface, sampling_params)
from rollpacker.rollout.sglang_routing import RoutingLayout

KEY_ENV = "ROLLPACKER_HOST_KEY"
PARENT_ENV = "ROLLPACKER_HOST_PARENT"  # the rank's pid: a host that outlived it before it could watch it exits
LOG_LEVEL_ENV = "ROLLPACKER_HOST_LOG_LEVEL"
DOORBELL_ENV = "ROLLPACKER_HOST_DOORBELL"  # the write end of the rank's doorbell pipe, inherited
CHILD_WATCH_S = 1.0  # how often the host checks that sglang's processes are alive


class _LoopThread:
    """The one thread that runs sglang's event loop (uvloop), for the engine's whole life.

    Coroutines are handed to the running loop (``run``, ``call``). sglang's synchronous methods
    (memory, weights, shutdown) drive that same loop with ``run_until_complete``: they run in this
    thread too, between two runs of the loop (``call_stopped``), so that the loop never changes
    threads, as in sglang's own server."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future, bool]] = queue.SimpleQueue()
        self._died: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="sglang-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            while True:
                self.loop.run_forever()  # until call_stopped stops it
                while not self._jobs.empty():  # this thread is the only consumer
                    fn, done, last = self._jobs.get_nowait()
                    try:
                        done.set_result(fn())
                    except BaseException as exc:  # the caller re-raises it
                        done.set_exception(exc)
                    if last:
                        return
        except BaseException as exc:  # a loop that died serves nothing: queued and later calls raise
            self._died = exc
            while not self._jobs.empty():
                self._jobs.get_nowait()[1].set_exception(RuntimeError("sglang's event loop died"))
            raise

    def _alive(self) -> None:
        if self._died is not None:
            raise RuntimeError("sglang's event loop died") from self._died

    def run(self, coro) -> concurrent.futures.Future:
        self._alive()
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop's thread (SGLang's objects are not thread-safe) and wait for it."""
        async def on_loop() -> Any:
            return fn()
        return self.run(on_loop()).result()

    def call_stopped(self, fn: Callable[[], Any], last: bool = False) -> Any:
        """Run ``fn`` in the loop's thread while the loop is stopped, and wait for it; ``last``: the
        thread ends after it."""
        self._alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, done, last))
        self.loop.call_soon_threadsafe(self.loop.stop)
        try:
            return done.result()
        finally:
            if last:
                self._thread.join()


@dataclass
class _Failure:
    request_id: str
    error: BaseException


class SGLangDriver:
    """Our ``RolloutEngine`` calls on one sglang ``Engine`` (or a test double with its interface) of the
    release ``surface`` describes."""

    def __init__(self, engine: Any, cfg: RolloutConfig, engine_id: int, surface: SGLangSurface,
                 vocab_size: int | None = None, doorbell: int | None = None, routing: RoutingLayout | None = None):
        """``vocab_size``: token ids at or above it are refused (sglang would index past its embedding);
        ``doorbell``: a pipe's write end, a byte written to it for every result (the rank sleeps on it);
        ``routing``: the MoE model's layout, where completions carry their routing (``cfg.return_routing``)."""
        self.cfg, self.engine_id, self.vocab_size, self._doorbell = cfg, engine_id, vocab_size, doorbell
        self.routing = routing
        self.engine, self.surface = engine, surface
        self._call = SGLangCalls(engine, surface)
        self._loop = _LoopThread(engine.loop)
        self._stats = EngineStats()
        self._active: dict[str, float] = {}  # request id -> submitted_at
        self._aborted: set[str] = set()
        self._evicting: set[str] = set()
        self._resumed: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {}  # continuation prefixes
        # Requests submitted with report_progress: [tokens generated so far, resumed ones included].
        # The loop thread writes the cell from sglang's stream; a request that leaves drops its cell
        # here, so a late write lands in a cell nobody reads.
        self._made: dict[str, list[int]] = {}
        self._results: queue.Queue[Completion | _Failure] = queue.Queue()
        # Requests sent to sglang whose result has not come back yet, aborted ones included: sglang
        # holds them (and so is not idle) until then. Changed on the loop thread, waited on by callers.
        self._in_sglang: set[str] = set()
        self._returned = threading.Condition()
        # Fixed at startup (the scheduler sizes its pool once): the token capacity the stream
        # trainer's hand-off weighs the projected KV demand against.
        self.kv_capacity = int(self._sync("Engine.get_server_info")["max_total_num_tokens"])

    # ---- request plane -------------------------------------------------------------------------
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        errors, refused = [], []
        for r in requests:
            problem = self._problem(r)
            if problem:
                errors.append(f"request {r.request_id!r}: {problem}")
                refused.append(r.request_id)
                continue
            self._active[r.request_id] = time.monotonic()
            if r.report_progress:
                self._made[r.request_id] = [len(r.resume_ids)]
            with self._returned:
                self._in_sglang.add(r.request_id)
            self._loop.run(self._generate(r, self._active[r.request_id]))
        if errors:
            raise RequestError("; ".join(errors), refused)

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        """Wait up to ``timeout`` (None: until one finishes) for a completion, then drain the rest."""
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
                self._forget(item.request_id)
            else:
                done.append(item)
                self._forget(item.request_id)
                self._stats.tokens_generated += len(item.output_ids)
        if failures:  # the completions are not lost: they come back with the next poll, which a ring wakes
            for c in done:
                self._result(c)
            raise RequestError("; ".join(f"request {f.request_id!r}: sglang failed it: {f.error!r}"
                                         for f in failures), [f.request_id for f in failures])
        return done

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in [r for r in request_ids if r in self._active]:
            self._forget(rid)
            self._aborted.add(rid)
            self._loop.call(lambda rid=rid: self._call("TokenizerManager.abort_request", rid=rid, abort_all=False))

    def abort_all(self) -> None:
        if self._active:
            self._aborted.update(self._active)
            self._active.clear()
            self._made.clear()
            self._loop.call(lambda: self._call("TokenizerManager.abort_request", rid="", abort_all=True))

    def evict(self, request_ids: Iterable[str], timeout_s: float = 60.0) -> list[Completion]:
        """Abort the requests and collect what SGLang returns for each: the output so far
        (finish reason "abort"), or the whole output of one that finished meanwhile."""
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
                submitted_at = self._active[item.request_id]
                self._forget(item.request_id)
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
                self._result(item)
        return handed

    def active_request_ids(self) -> list[str]:
        return list(self._active)

    def progress(self, request_ids: Sequence[str]) -> list[int]:
        """Tokens generated as of sglang's last chunk that found the request unfinished (it streams
        every ``stream_interval`` decode steps: a count lags by less than that, never leads; a
        request that finished meanwhile keeps its last unfinished count)."""
        missing = [rid for rid in request_ids if rid not in self._made]
        if missing:
            raise KeyError(f"engine {self.engine_id}: no progress for requests {missing[:4]}: not in flight or "
                           f"not submitted with report_progress")
        return [self._made[rid][0] for rid in request_ids]

    # ---- control plane -------------------------------------------------------------------------
    def begin_weights(self) -> None:
        """Open the release's weight-update session, if it has one (``SGLangSurface.weight_session``)."""
        if self.surface.weight_session:
            self._checked("Engine.begin_weight_update", "opening the weight-update session")

    def push(self, bucket: list[tuple[str, torch.Tensor]], flush_cache: bool) -> None:
        if flush_cache and self.surface.flush_needs_idle:  # the scheduler would assert the flush
            self.wait_idle()
        self._checked("Engine.update_weights_from_tensor", f"tensors {[name for name, _ in bucket]}",
                      named_tensors=bucket, load_format=None, flush_cache=flush_cache)

    def end_weights(self) -> None:
        if self.surface.weight_session:
            self._checked("Engine.end_weight_update", "closing the weight-update session")

    def close_weights(self) -> None:
        """After a failed push: close the session, since one left open makes the next
        ``begin_weight_update`` fail ("a weight-update session is already open"). The push's error
        is the one to report, so a failure to close is not raised over it."""
        if self.surface.weight_session:
            with contextlib.suppress(Exception):
                self._sync("Engine.end_weight_update")

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Release once the engine is idle (aborted requests drained): see ``wait_idle``."""
        self._memory("Engine.release_memory_occupation", tags)

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._memory("Engine.resume_memory_occupation", tags)

    def wait_idle(self, timeout_s: float | None = None) -> None:
        """Block until sglang holds none of our requests: every one sent has come back (an aborted
        request ends only after the scheduler's next forward) and the scheduler's load snapshot
        shows nothing running or waiting. Raises ``TimeoutError`` after ``cfg.drain_timeout_s``."""
        timeout_s = self.cfg.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._returned:
            if not self._returned.wait_for(lambda: not self._in_sglang, timeout=timeout_s):
                raise TimeoutError(f"engine {self.engine_id}: sglang has not returned requests "
                                   f"{sorted(self._in_sglang)[:8]} ({len(self._in_sglang)} in all) "
                                   f"{timeout_s}s after they were sent or aborted")
        # A result reaches us before the scheduler has dropped the finished batch; it publishes a
        # fresh snapshot on going idle.
        while (load := self.engine_load()) is not None and (load.num_running_reqs or load.num_waiting_reqs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id}: sglang still reports {load.num_running_reqs} "
                                   f"running and {load.num_waiting_reqs} waiting requests {timeout_s}s "
                                   f"after all of ours came back")
            time.sleep(0.01)

    def stats(self) -> EngineStats:
        """The engine's own load (running, waiting, KV tokens in use, of ``max_total_num_tokens``);
        preemptions = retractions. ``extra["in_flight"]`` counts requests not yet returned to us."""
        load = self.engine_load()
        return EngineStats(running=load.num_running_reqs if load else len(self._active),
                           waiting=load.num_waiting_reqs if load else 0,
                           kv_tokens_used=load.num_used_tokens if load else 0,
                           kv_tokens_capacity=self.kv_capacity,
                           preemptions=self._stats.preemptions, tokens_generated=self._stats.tokens_generated,
                           extra={"backend": "sglang", "in_flight": len(self._active),
                                  "load_snapshot": load is not None})

    def engine_load(self) -> Any:
        """The scheduler's latest load snapshot, or None if it publishes none. For the host's own use:
        it is sglang's object, and unpickling it in a rank would import sglang there (``stats``
        carries its figures across)."""
        loads = self._loop.run(self._call("TokenizerManager.get_loads")).result(timeout=LOAD_TIMEOUT_S)
        return loads[0] if loads else None

    def shutdown(self) -> None:
        self.abort_all()
        self._loop.call_stopped(lambda: self._call("Engine.shutdown"), last=True)

    # ---- internals -----------------------------------------------------------------------------
    def _problem(self, r: GenerationRequest) -> str | None:
        try:
            r.params.validate()
        except RequestError as exc:
            return str(exc)
        if not r.input_ids:
            return "empty prompt"
        if self.vocab_size is not None:
            bad = [t for t in (*r.input_ids, *r.resume_ids, *r.params.stop_token_ids) if not 0 <= t < self.vocab_size]
            if bad:
                return f"token ids {bad[:4]} outside the model's vocabulary [0, {self.vocab_size})"
        if len(r.resume_ids) != len(r.resume_logprobs) or len(r.resume_ids) >= r.params.max_new_tokens:
            return (f"resumes {len(r.resume_ids)} tokens with {len(r.resume_logprobs)} log-probs; need equal "
                    f"counts below max_new_tokens ({r.params.max_new_tokens})")
        if r.request_id in self._active:
            return "a request with this id is already in flight"
        return None

    async def _generate(self, r: GenerationRequest, submitted_at: float) -> None:
        # A resumed request is a continuation: its tokens so far join the prompt (SGLang rebuilds
        # their KV by prefill) and are put back in front of the output. The rest of the response is
        # a fresh sample (SGLang ignores the seed, see sglang_backend), equally valid but not
        # the one the unmigrated request would have given, unlike the reference engine.
        if r.resume_ids:
            self._resumed[r.request_id] = (tuple(r.resume_ids), tuple(r.resume_logprobs))
        params = dataclasses.replace(r.params, max_new_tokens=r.params.max_new_tokens - len(r.resume_ids))
        call = dict(input_ids=[*r.input_ids, *r.resume_ids], sampling_params=sampling_params(params),
                    return_logprob=True, rid=r.request_id)
        if self.routing is not None:
            call["return_routed_experts"] = True
        try:
            if r.report_progress:
                # sglang's stream (not incremental: each chunk holds the output so far, the last one
                # all of it, as unstreamed) costs a message per chunk: only requests that are counted
                out, made = None, self._made.get(r.request_id, [0])
                async for out in await self._call("Engine.async_generate", **call, stream=True):
                    if out["meta_info"]["finish_reason"] is None:  # still running after these tokens
                        made[0] = len(r.resume_ids) + int(out["meta_info"]["completion_tokens"])
                if out is None:
                    raise RuntimeError("sglang's stream ended without output")
            else:
                out = await self._call("Engine.async_generate", **call)
            c = completion(r.request_id, out, submitted_at, self.engine_id)
            prefix_ids, prefix_lps = self._resumed.pop(r.request_id, ((), ()))
            c.output_ids, c.logprobs = [*prefix_ids, *c.output_ids], [*prefix_lps, *c.logprobs]
            if self.routing is not None:  # an aborted request's: whatever sglang gave (sglang_routing)
                fed = None if c.finish_reason == FINISH_ABORT else len(r.input_ids) + len(c.output_ids) - 1
                c.routed_experts = self.routing.decode(out["meta_info"], fed)
            self._stats.preemptions += int(out["meta_info"].get("num_retractions", 0))
            if c.finish_reason == FINISH_ABORT and r.request_id in self._evicting:
                c.finish_reason = FINISH_EVICTED
                self._result(c)
            else:
                self._result(_Failure(r.request_id, RuntimeError("aborted by SGLang"))
                             if c.finish_reason == FINISH_ABORT else c)
        except Exception as exc:  # an aborted request may end in an exception; poll sorts it out
            self._result(_Failure(r.request_id, exc))
        finally:
            with self._returned:
                self._in_sglang.discard(r.request_id)
                self._returned.notify_all()

    def _forget(self, request_id: str) -> None:
        """The request left ``_active``: returned by ``poll`` or ``evict``, or aborted."""
        self._active.pop(request_id, None)
        self._made.pop(request_id, None)

    def _result(self, item: Completion | _Failure) -> None:
        """A request's result, for the next ``poll``; the rank's doorbell rings (a full pipe already rings)."""
        self._results.put(item)
        if self._doorbell is not None:
            with contextlib.suppress(BlockingIOError):
                os.write(self._doorbell, b"\0")

    def _memory(self, qualname: str, tags: Sequence[str]) -> None:
        unknown = set(tags) - set(MEMORY_TAGS)
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)}; valid: {MEMORY_TAGS}")
        if self._active:
            raise RuntimeError(f"engine {self.engine_id}: {qualname.split('.')[1]} needs an idle engine "
                               f"({len(self._active)} requests in flight)")
        self.wait_idle()
        self._sync(qualname, tags=list(tags))

    def _checked(self, qualname: str, subject: str, **kwargs: Any) -> None:
        """Call a control method that answers ``(success, message)`` and raise unless it succeeded."""
        result = self._sync(qualname, **kwargs)
        ok, message = result if isinstance(result, tuple) and len(result) == 2 else (False, repr(result))
        if not ok:
            raise WeightSyncError(f"engine {self.engine_id}: sglang refused {qualname.split('.')[1]} "
                                  f"({subject}): {message}")

    def _sync(self, qualname: str, **kwargs: Any) -> Any:
        """One of sglang's synchronous methods, which run the loop themselves (``_LoopThread.call_stopped``)."""
        return self._loop.call_stopped(lambda: self._call(qualname, **kwargs))


# ---- the host process ------------------------------------------------------------------------------

def serve(conn: Connection, driver: SGLangDriver) -> None:
    """Answer the rank's calls until it hangs up: ``(method, args, kwargs)`` -> ``("ok", result)``
    or ``("error", exception)``. ``push`` carries its bucket pickled (see ``sglang_backend``)."""
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if method == "push":
                args = (_own(pickle.loads(args[0])), *args[1:])
            reply = ("ok", getattr(driver, method)(*args, **kwargs))
        except Exception as exc:  # the rank re-raises it
            reply = ("error", _picklable(exc))
        _keep_sigterm_ignored(driver.engine.loop)
        conn.send(reply)
        if method == "shutdown":
            return


def _own(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """CUDA tensors arrive as IPC views of the rank's memory; sglang passes what it is given on to its
    TP workers through CUDA IPC again, and memory opened from an IPC handle cannot be exported
    (``cudaIpcGetMemHandle`` takes ``cudaMalloc`` memory), so the host copies them into its own."""
    return [(name, t.clone() if t.is_cuda else t) for name, t in bucket]


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _keep_sigterm_ignored(loop: asyncio.AbstractEventLoop) -> None:
    """sglang installs a SIGTERM loop handler on its first main-thread call: take it off again."""
    with contextlib.suppress(Exception):
        loop.remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _die_with_parent() -> None:
    """If the rank dies (kill -9 included), the kernel sends this host SIGKILL (Linux). A rank that
    died before this ran sends nothing: the host, reparented by then, would wait for it forever."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None and os.getppid() != int(parent):
        os._exit(1)


def _children(pid: int) -> set[int]:
    """The direct children of ``pid`` (Linux ``/proc``)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out.update(int(c) for c in task.read_text().split())
    return out


def _watch(children: set[int]) -> None:
    """End the whole host group as soon as one of sglang's processes has gone: a dead scheduler
    would otherwise leave the rank waiting for results forever."""
    while True:
        time.sleep(CHILD_WATCH_S)
        for pid in children:
            state = ""
            with contextlib.suppress(OSError):
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state in ("", "Z", "X"):
                # one write: the rank may kill the group meanwhile (its shutdown), and a line cut before
                # its newline ran into the next line of the output the rank's caller parses
                line = f"[sglang-host {os.getpid()}] sglang process {pid} exited; ending the engine host\n"
                os.write(2, line.encode())
                os.killpg(0, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # sglang logs through the root logger; the rank passes its own level (INFO on rank 0).
    logging.basicConfig(level=int(os.environ.get(LOG_LEVEL_ENV, logging.INFO)),
                        format=f"[sglang-host {os.getpid()}] %(asctime)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the rank, which ends the host
    _die_with_parent()
    doorbell = int(os.environ.pop(DOORBELL_ENV))
    with Listener(argv[0], family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(KEY_ENV))) as listener:
        os.write(doorbell, b"\0")  # listening: the rank connects on this ring (its pipe is empty yet)
        conn = listener.accept()
    spec = conn.recv()
    try:
        surface = installed_surface()  # refuses an unsupported release before sglang is imported
        check_call(surface, "Engine.__init__", spec["kwargs"])
        import sglang
        os.set_blocking(doorbell, False)
        routing = RoutingLayout.of_model(spec["kwargs"]["model_path"]) if spec["cfg"].return_routing else None
        driver = SGLangDriver(sglang.Engine(**spec["kwargs"]), spec["cfg"], spec["engine_id"], surface,
                              spec["vocab_size"], doorbell=doorbell, routing=routing)
    except Exception as exc:
        conn.send(("error", RuntimeError(f"the sglang engine did not start: {type(exc).__name__}: {exc}\n"
                                         f"{traceback.format_exc()}")))
        return 1
    _keep_sigterm_ignored(driver.engine.loop)
    threading.Thread(target=_watch, args=(_children(os.getpid()),), name="sglang-watch", daemon=True).start()
    conn.send(("ok", {"kv_capacity": driver.kv_capacity, "pid": os.getpid(), "sglang": surface.version}))
    serve(conn, driver)
    return 0


if __name__ == "__main__":
    sys.exit(main())
