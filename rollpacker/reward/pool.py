"""A pool of CPU worker processes that score each response as soon as it is submitted.

One dispatcher thread in the caller's process owns every worker: it hands
queued jobs to idle workers, a batch at a time (one message for many jobs: on a
trainer's rank 0 the per-job round trip, not the scoring, was the cost),
collects each outcome into its future as the worker sends it, and watches each
busy worker against a deadline (the current sample's own scoring budget plus a
grace period).  A response may be submitted as token ids: the worker decodes it.
A worker that dies or misses its deadline is killed with its whole process
group and replaced; its sample is retried once on a fresh worker, and
scored as a failure (``crash`` or ``timeout``) if that attempt fails too.
Nothing here runs scoring code in the caller's process.

A killed worker leaves its sandboxed program's leftovers to the pool: the
program (in a session of its own), whatever of its process group came back to
this process to be reaped, and its working directory, which lies in a scratch
directory the pool made for that worker and removes with it.
"""
from __future__ import annotations

import array
import atexit
import collections
import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Sequence

from rollpacker.reward.adaptive import CodeTimeouts
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.sandbox import SandboxLimits
from rollpacker.reward.score import CRASH, ERROR, TIMEOUT, Score
from rollpacker.reward.scorers import CODE, JUDGE, MATH, scorer_for
from rollpacker.reward.scorers.code import parse_tests
from rollpacker.reward.worker import READY, Job, Outcome, WorkerSettings, worker_main
from rollpacker.wakeup import Waiter

if TYPE_CHECKING:
    from rollpacker.reward.scorers.judge import LLMJudge

log = logging.getLogger(__name__)
_MAX_ATTEMPTS = 2  # a sample whose worker dies or hangs is retried once
_MAX_START_FAILURES = 3  # per worker slot, before the pool gives up (a broken install, not bad input)
_MAX_BATCH = 64  # jobs sent to a worker in one message; queued jobs are split evenly over the idle workers


@dataclass(frozen=True)
class PoolStats:
    workers_alive: int
    workers_replaced: int
    in_flight: int
    queued: int
    retried: int
    worker_pids: tuple[int, ...]


@dataclass
class _Request:
    job: Job
    future: Future
    budget: float  # seconds on a worker before it counts as hung
    prompt_key: str | None = None  # code: whose timeout anchors the outcome updates
    adapt: bool = True  # False: the outcome leaves the timeouts as they are (eval samples)
    alone: bool = False  # sent to a worker in a batch of its own (its worker died on a batch)
    attempts: int = 0
    seconds: float = 0.0  # worker time over all attempts


@dataclass
class _Slot:
    index: int
    process: BaseProcess
    conn: Connection  # the pool's end of the worker's pipe
    scratch: str  # where the worker's programs get their working directories; removed with the worker
    program: int | None = None  # pid (and process group) of the program the current job runs
    ready: bool = False
    # the batch sent to the worker, (job id, request) in the order it runs them: the first is running
    batch: collections.deque[tuple[int, _Request]] = dataclasses.field(default_factory=collections.deque)
    job_id: int = 0
    started_at: float = 0.0  # when the running job started
    deadline: float = 0.0

    def start_next(self) -> None:
        """The batch's first job starts now: the worker began it when it sent the previous outcome."""
        self.started_at = time.monotonic()
        self.deadline = self.started_at + self.batch[0][1].budget


class RewardPool:
    """``submit`` returns a Future[Score]; it blocks while ``cfg.queue_size`` jobs wait.

    An optional ``judge`` scores ``data_source == "judge"`` samples; the pool closes it on ``close``.
    With a ``tokenizer`` (picklable: each worker gets a copy), responses may be submitted as token
    ids and are decoded in the workers, off the caller's thread.
    """

    def __init__(self, cfg: RewardConfig, *, judge: LLMJudge | None = None, tokenizer: Any = None):
        cfg.validate()
        self._cfg = cfg
        self._judge = judge
        self._tokenizer = tokenizer
        self._ctx = mp.get_context(cfg.start_method)
        if cfg.start_method == "forkserver":
            # The fork server imports the scorers once; a replacement worker then starts in
            # milliseconds instead of re-importing sympy.  (No effect if the server already runs.)
            self._ctx.set_forkserver_preload(["rollpacker.reward.worker", "rollpacker.reward.scorers.math_answer"])
        self._timeouts = CodeTimeouts(cfg)
        self._queue: queue.Queue[_Request] = queue.Queue(maxsize=cfg.queue_size)
        self._retry: collections.deque[_Request] = collections.deque()
        self._submit_lock = threading.Lock()
        self._closing = False  # no more submissions: set by close() or by a failed dispatcher
        self._closed = False
        self._abandoned = False  # the process exits without close(): stop, replace no worker
        self._replaced = self._retried = self._start_failures = 0
        self._all_ready = threading.Event()
        # the dispatcher sleeps until a worker answers or dies, a submit (or close) wakes it, or a budget ends
        self._waiter = Waiter()
        self._slots = [self._start_worker(i) for i in range(cfg.num_workers)]
        self._thread = threading.Thread(target=self._dispatch, name="reward-dispatcher", daemon=True)
        self._thread.start()
        atexit.register(self._abandon)

    # ---- public API -------------------------------------------------------------------
    def submit(self, data_source: str, response: str | Sequence[int], label: Any, *, key: str | None = None,
               adapt: bool = True) -> Future:
        """Queue one response (its text, or its token ids with a pool made with a tokenizer) for
        scoring. Raises ValueError for a sample no scorer accepts.
        ``adapt=False``: score with the current code timeouts but do not update them (an eval must
        leave the training state as it found it)."""
        scorer = scorer_for(data_source)
        if not isinstance(response, str) and self._tokenizer is None:
            raise ValueError("a response given as token ids needs a pool made with a tokenizer: "
                             "RewardPool(cfg, tokenizer=...)")
        if scorer == JUDGE:
            if self._judge is None:
                raise ValueError(f"data_source {data_source!r} needs an LLM judge: RewardPool(cfg, judge=...)")
            if not isinstance(response, str):  # the judge runs here, not in a worker
                response = self._tokenizer.decode(list(response), skip_special_tokens=True)
            return self._judge.submit(response, label)
        if not isinstance(response, (str, array.array)):
            response = array.array("i", response)  # pickles as its bytes: the cheapest way to a worker
        request = self._request(scorer, response, label, key)
        request.adapt = adapt
        with self._submit_lock:
            if self._closing:
                raise RuntimeError("RewardPool.submit after close() or after its dispatcher failed")
            self._queue.put(request)
        self._waiter.wake()
        return request.future

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every worker has started (imports done); False on timeout."""
        return self._all_ready.wait(timeout)

    def close(self) -> None:
        """Finish every submitted sample, then stop the workers."""
        with self._submit_lock:
            if self._closed:
                return
            self._closing = self._closed = True
        atexit.unregister(self._abandon)
        self._waiter.wake()
        self._thread.join()
        self._waiter.close()
        if self._judge is not None:
            self._judge.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        return {"code_timeouts": self._timeouts.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "code_timeouts" not in state:
            raise ValueError("reward state_dict has no 'code_timeouts' entry")
        self._timeouts.load_state_dict(state["code_timeouts"])

    @property
    def code_timeouts(self) -> CodeTimeouts:
        return self._timeouts

    def stats(self) -> PoolStats:
        slots = list(self._slots)
        return PoolStats(workers_alive=sum(s.process.is_alive() for s in slots), workers_replaced=self._replaced,
                         in_flight=sum(len(s.batch) for s in slots),
                         queued=self._queue.qsize() + len(self._retry), retried=self._retried,
                         worker_pids=tuple(s.process.pid for s in slots))

    # ---- submission ---------------------------------------------------------------------
    def _request(self, scorer: str, response: str, label: Any, key: str | None) -> _Request:
        if not isinstance(response, (str, array.array)):
            raise ValueError(f"response must be a str or token ids, got {type(response).__name__}")
        grace = self._cfg.worker_grace
        if scorer == CODE:  # its timeouts are set at dispatch, from the anchors known by then
            prompt_key = key if key is not None else _content_key(label)
            return _Request(Job(CODE, response, parse_tests(label)), Future(), grace, prompt_key)
        if not isinstance(label, (str, int, float)) or isinstance(label, bool):
            raise ValueError(f"{scorer} ground truth must be a string, got {type(label).__name__} {label!r:.80}")
        # math-verify may spend its timeout on each of: gold parse, response parse, verify
        budget = 3 * self._cfg.math_timeout + grace if scorer == MATH else grace
        return _Request(Job(scorer, response, str(label)), Future(), budget)

    def _abandon(self) -> None:
        """At exit without ``close()`` (the process is failing): stop the workers now. Left to
        multiprocessing's exit handler (registered earlier, so run after this one), they would die
        under a running dispatcher, which would take them for crashes and restart them."""
        self._abandoned = self._closing = True
        self._waiter.wake()
        self._thread.join(10)

    # ---- workers ------------------------------------------------------------------------
    def _start_worker(self, index: int) -> _Slot:
        cfg = self._cfg
        scratch = tempfile.mkdtemp(prefix=f"rollpacker-reward-{index}-")
        os.chmod(scratch, 0o711)  # the sandbox uid must reach its working directory in here, not list it
        limits = SandboxLimits(memory_mb=cfg.code_memory_mb, file_size_mb=cfg.code_file_size_mb,
                               max_processes=cfg.code_max_processes, output_limit_bytes=cfg.code_output_limit_bytes,
                               uid=None if cfg.sandbox_uid is None else cfg.sandbox_uid + index,
                               scratch_root=scratch)
        ours, theirs = self._ctx.Pipe()
        settings = WorkerSettings(cfg.math_timeout, limits, self._tokenizer, cfg.math_extract)
        process = self._ctx.Process(target=worker_main, args=(theirs, settings), name=f"reward-worker-{index}",
                                    daemon=True)
        process.start()
        theirs.close()
        self._waiter.watch(ours.fileno(), process.sentinel)
        return _Slot(index, process, ours, scratch)

    def _stop_worker(self, slot: _Slot) -> None:
        """Kill and reap the worker, end the program it was running, remove its scratch directory."""
        if not slot.conn.closed:  # once: a stop that failed midway may be repeated
            self._waiter.unwatch(slot.conn.fileno(), slot.process.sentinel)
        if slot.process.exitcode is None:  # once reaped, its pid may name another process group
            try:
                os.killpg(slot.process.pid, signal.SIGKILL)  # the worker leads its own session
            except (ProcessLookupError, PermissionError):
                pass
        slot.process.join(5)
        try:  # the program's pid may still wait in the pipe, sent just before the worker died
            while slot.conn.poll():
                self._note_program(slot, slot.conn.recv())
        except (EOFError, OSError):
            pass
        slot.conn.close()
        if slot.program is not None:
            _end_program(slot.program)
        shutil.rmtree(slot.scratch, ignore_errors=True)

    @staticmethod
    def _note_program(slot: _Slot, message: Any) -> None:
        """Track the program the worker runs: set by a PROGRAM message, cleared by outcomes (the
        worker has reaped their jobs' programs by then)."""
        if isinstance(message, list):
            slot.program = None
        elif message != READY:
            slot.program = message[1]

    def _fail(self, slot: _Slot, reason: str, detail: str) -> None:
        """The worker in ``slot`` died or hung: replace it, retry or fail the sample it was scoring.
        Of a batch of several, which sample did it is unknown (a worker sends outcomes in lists: the
        last ones died with it), so each goes back to the front of the queue to be scored alone, no
        attempt spent; a sample alone that kills its worker is the culprit."""
        batch = [r for _, r in slot.batch]
        slot.batch.clear()
        request = batch[0] if len(batch) == 1 else None
        if len(batch) > 1:
            for r in batch:
                r.alone = True
            self._retry.extendleft(reversed(batch))
        log.warning("reward worker %d (pid %s): %s; replacing it", slot.index, slot.process.pid, detail)
        if not slot.ready:
            self._start_failures += 1
            if self._start_failures > _MAX_START_FAILURES * self._cfg.num_workers:
                raise RuntimeError(f"reward workers keep dying before they are ready: {detail}")
        self._stop_worker(slot)
        self._all_ready.clear()
        self._slots[slot.index] = self._start_worker(slot.index)
        self._replaced += 1
        if request is None:
            return
        request.seconds += time.monotonic() - slot.started_at
        request.attempts += 1
        if request.attempts < _MAX_ATTEMPTS:
            self._retried += 1
            self._retry.append(request)
        else:
            request.future.set_result(Score.failed(reason, f"{detail} on both attempts", request.seconds))

    # ---- dispatcher thread --------------------------------------------------------------
    def _dispatch(self) -> None:
        try:
            while True:
                self._assign()
                busy = [s for s in self._slots if s.batch]
                if self._closing and not busy and not self._retry and self._queue.empty():
                    break
                timeout = math.ceil(max(0.0, min(s.deadline for s in busy) - time.monotonic()) * 1000) if busy else None
                ready = self._waiter.wait(timeout)  # a wake is drained before the next _assign reads the queue
                if self._abandoned:
                    break
                for slot in list(self._slots):
                    if slot.conn.fileno() in ready:
                        self._receive(slot)
                for slot in list(self._slots):
                    if slot.process.sentinel in ready and not slot.process.is_alive():
                        self._fail(slot, CRASH, f"worker died (exit code {slot.process.exitcode})")
                now = time.monotonic()
                for slot in list(self._slots):
                    if slot.batch and now > slot.deadline:
                        self._fail(slot, TIMEOUT, f"worker exceeded the {slot.batch[0][1].budget:.1f}s budget")
        except BaseException:  # noqa: BLE001 - a dispatcher bug must not leave futures hanging
            log.exception("reward dispatcher failed")
            self._closing = True  # later submits raise instead of waiting forever
            self._fail_pending("reward dispatcher failed; see the log")  # also unblocks a submit stuck on a full queue
            with self._submit_lock:  # that submit has now queued its request: fail it too
                self._fail_pending("reward dispatcher failed; see the log")
            raise
        finally:
            for slot in self._slots:
                try:
                    slot.conn.send(None)
                except OSError:
                    pass
                slot.process.join(2)
                self._stop_worker(slot)

    def _assign(self) -> None:
        """Send each idle worker its share of the queued jobs, in one message."""
        idle = [s for s in self._slots if s.ready and not s.batch]
        for n, slot in enumerate(idle):
            queued = self._queue.qsize() + len(self._retry)
            share = min(_MAX_BATCH, -(-queued // (len(idle) - n)))
            while len(slot.batch) < share and (request := self._next_request()) is not None:
                # code goes alone: its timeouts are set as it starts, from every anchor known by then
                if request.alone or request.prompt_key is not None:
                    if slot.batch:
                        self._retry.appendleft(request)
                        break
                    share = 1
                if request.prompt_key is not None:
                    timeouts = self._timeouts.timeouts(request.prompt_key, len(request.job.label))
                    request.job = dataclasses.replace(request.job, timeouts=timeouts)
                    request.budget = sum(timeouts) + self._cfg.worker_grace
                slot.job_id += 1
                slot.batch.append((slot.job_id, request))
            if not slot.batch:
                return
            slot.start_next()
            try:
                slot.conn.send([(job_id, request.job) for job_id, request in slot.batch])
            except OSError:
                self._fail(slot, CRASH, "worker pipe closed")

    def _next_request(self) -> _Request | None:
        if self._retry:
            return self._retry.popleft()
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return None
            if request.future.set_running_or_notify_cancel():
                return request

    def _receive(self, slot: _Slot) -> None:
        """Every message the worker has sent so far."""
        while True:
            try:
                message = slot.conn.recv()
            except (EOFError, OSError):
                self._fail(slot, CRASH, "worker pipe closed")
                return
            self._note_program(slot, message)
            if message == READY:
                slot.ready = True
                if all(s.ready for s in self._slots):
                    self._all_ready.set()
            elif isinstance(message, list):  # outcomes, in the batch's order
                for job_id, outcome in message:
                    if slot.batch and job_id == slot.batch[0][0]:
                        _, request = slot.batch.popleft()
                        request.seconds += outcome.seconds
                        if slot.batch:
                            slot.start_next()
                        self._finish(request, outcome)
            if not slot.conn.poll():
                return

    def _finish(self, request: _Request, outcome: Outcome) -> None:
        if request.adapt and request.prompt_key is not None and outcome.passed_case_seconds:
            self._timeouts.observe(request.prompt_key, outcome.passed_case_seconds)
        request.future.set_result(dataclasses.replace(outcome.score, seconds=request.seconds))

    def _fail_pending(self, detail: str) -> None:
        pending = [r for s in self._slots for _, r in s.batch] + list(self._retry)
        while not self._queue.empty():
            pending.append(self._queue.get_nowait())
        for request in pending:
            if not request.future.done():
                request.future.set_result(Score.failed(ERROR, detail, request.seconds))


def _end_program(pgid: int, patience: float = 5.0) -> None:
    """Kill the process group of a program whose worker died mid-run, and reap its members that came
    back to this process.

    The program leads its own session, so the worker's group kill misses it; its parent-death signal
    ends the program, not what it started. Orphans go to the nearest child subreaper or PID 1, which is
    this process when the trainer is a container's init: unreaped there, they stay zombies. A group id
    is not reused while a member lives, so the kill reaches no one else.
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + patience
    while True:
        try:
            reaped, _ = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:  # no member of the group is (any longer) a child of this process
            return
        if reaped == 0:
            if time.monotonic() > deadline:
                log.warning("sandboxed program group %d outlived SIGKILL by %.0fs; not reaped", pgid, patience)
                return
            time.sleep(0.005)


def _content_key(tests: Any) -> str:
    """A prompt key for code samples submitted without one: the same tests, the same key."""
    return hashlib.sha1(json.dumps(tests, sort_keys=True).encode()).hexdigest()[:16]
