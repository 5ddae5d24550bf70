"""Test venv only: on SIGUSR2, an sglang engine host writes where its requests wait.

Loaded by ``rollpacker_stall_dump.pth`` in every process of the test venv, and armed only where
``ROLLPACKER_STALL_DUMP_DIR`` names a folder (``host_checks.py`` sets it for the engine hosts it
starts). The dump goes to ``<dir>/host-<pid>.txt``: per ``TokenizerManager``, its pause flag, the
reader/writer counts of its weight-update lock, what its socket to the scheduler has queued, its
open request states, and every task of its event loop with its stack; the host's flock calls and
log writes that blocked over 50 ms; when each coroutine around the last generation was handed to
the loop, started and ended; and when each reply left for the rank. With the rank's own record of
when its reads came back (``lifecycle_checks.wait_until_running``), that tells a late engine from
a late rank: the last stall was the rank, importing sglang to unpickle an sglang object.
"""
from __future__ import annotations

import os
import signal

DIR_ENV = "ROLLPACKER_STALL_DUMP_DIR"


def _describe(manager) -> list[str]:
    import asyncio

    lock = manager.model_update_lock
    sock = manager.send_to_scheduler
    lines = [f"TokenizerManager: is_pause={manager.is_pause} readers={lock._readers} "
             f"writer_active={lock._writer_active} waiting_writers={lock._waiting_writers} "
             f"is_pause_cond_locked={manager.is_pause_cond.locked()}",
             f"send_to_scheduler: queued sends={len(getattr(sock, '_send_futures', ()))} "
             f"io state={getattr(sock, '_state', '?')} closed={sock.closed}",
             f"event loop: running={manager.event_loop.is_running() if manager.event_loop else None}"]
    for rid, state in list(manager.rid_to_state.items()):
        lines.append(f"request {rid}: finished={getattr(state, 'finished', '?')} "
                     f"dispatched={getattr(state, 'dispatched', '?')} outputs={len(getattr(state, 'out_list', []))}")
    if manager.event_loop is not None:
        for _ in range(3):  # the loop's thread may change the task set while it is read
            try:
                tasks = list(asyncio.all_tasks(manager.event_loop))
                break
            except RuntimeError:
                tasks = []
        for task in tasks:
            lines.append(f"task {task.get_name()}:")
            lines.extend(_awaits(task.get_coro()))
    return lines


def _awaits(coro) -> list[str]:
    """The chain of coroutines and async generators ``coro`` waits through, outermost first
    (``Task.get_stack`` shows only the outermost frame of a suspended coroutine)."""
    lines = []
    while coro is not None and len(lines) < 24:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        else:
            lines.append(f"    {coro!r}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


def _describe_driver(driver) -> list[str]:
    """Our side of the host: the thread that runs sglang's loop, and the requests it holds."""
    import asyncio

    thread, loop = driver._loop._thread, driver._loop.loop
    lines = [f"SGLangDriver engine {driver.engine_id}: loop thread {thread.name if thread else None} "
             f"alive={thread.is_alive() if thread else None} running={loop.is_running()} "
             f"same loop as the tokenizer manager={loop is driver.engine.tokenizer_manager.event_loop} "
             f"loop={type(loop).__module__}.{type(loop).__name__} active={list(driver._active)[:8]} "
             f"in sglang={sorted(driver._in_sglang)[:8]} results queued={driver._results.qsize()}"]
    import time
    now = time.monotonic()
    for item in list(driver._results.queue):  # results no poll has taken yet, with their times
        done = getattr(item, "finished_at", None)
        lines.append(f"queued result {item.request_id}: " + (
            f"{item.finish_reason}, {len(item.output_ids)} tokens, submitted {now - item.submitted_at:.1f} s ago, "
            f"finished {now - done:.1f} s ago" if done is not None else f"failure {item.error!r}"))
    if loop is not driver.engine.tokenizer_manager.event_loop:
        for task in list(asyncio.all_tasks(loop)):
            lines.append(f"task {task.get_name()} (the driver's loop):")
            lines.extend(_awaits(task.get_coro()))
    return lines


def _dump(signum, frame) -> None:
    import faulthandler
    import gc

    lines: list[str] = []
    for obj in gc.get_objects():
        kind = type(obj).__name__
        if kind in ("TokenizerManager", "SGLangDriver"):
            try:
                lines.extend(_describe(obj) if kind == "TokenizerManager" else _describe_driver(obj))
            except Exception as exc:  # noqa: BLE001 - a diagnostic: say what could not be read
                lines.append(f"could not describe {obj!r}: {exc!r}")
    import time
    lines.append(f"now {time.monotonic():.2f} (monotonic); blocking calls over {SLOW_S} s: {SLOW or 'none'}")
    # around the last generation handed over: where a stall starts
    last = max((i for i, entry in enumerate(HANDED) if "_generate" in entry[0]), default=len(HANDED) - 1)
    lines.append("coroutines handed to the loop around the last generation (handed over, started, ended; monotonic):")
    lines.extend(f"  {what} from {thread}: {t0:.2f} {'never' if t1 is None else f'{t1:.2f}'} "
                 f"{'never' if t2 is None else f'{t2:.2f}'}" for what, t0, t1, t2, thread in HANDED[max(0, last - 5):last + 25])
    if HANDED[max(0, last - 5):]:
        since = HANDED[max(0, last - 5)][1]
        lines.append("replies sent to the rank from then on (monotonic): "
                     + " ".join(f"{t:.2f}" for t in SENT if t >= since)[:600])
    path = os.path.join(os.environ[DIR_ENV], f"host-{os.getpid()}.txt")
    with open(path + ".part", "w") as f:
        f.write("\n".join(lines or ["no TokenizerManager in this process"]) + "\n\nthreads:\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    os.replace(path + ".part", path)  # the reader waits for the whole file


SLOW_S = 0.05
SLOW: list[str] = []  # blocking calls of this process that took over SLOW_S, for the dump


def _timed(fn, what: str):
    """``fn``, recording each call that blocks over SLOW_S (with the thread it blocked)."""
    import functools
    import threading
    import time

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.monotonic() - started
            if took > SLOW_S and len(SLOW) < 200:
                SLOW.append(f"{what} took {took:.2f} s in thread {threading.current_thread().name}, "
                            f"ended {time.monotonic():.2f} (monotonic)")
    return timed


HANDED: list[list] = []  # [what, handed over, started on the loop, ended, handing thread], the last 5000


def _handed(run_coroutine_threadsafe):
    """``asyncio.run_coroutine_threadsafe``, recording when each coroutine is handed to the loop and
    when the loop starts and ends it: a late start is the loop's, a late hand-over the caller's."""
    import threading
    import time

    def handed(coro, loop):
        entry = [getattr(coro, "__qualname__", repr(coro)), time.monotonic(), None, None,
                 threading.current_thread().name]
        HANDED.append(entry)
        del HANDED[:-5000]

        async def timed():
            entry[2] = time.monotonic()
            try:
                return await coro
            finally:
                entry[3] = time.monotonic()
        return run_coroutine_threadsafe(timed(), loop)
    return handed


SENT: list[float] = []  # when the host's main thread sent each reply to the rank, the last 5000


def _sent(send):
    import time

    def timed_send(self, obj):
        try:
            return send(self, obj)
        finally:
            SENT.append(time.monotonic())
            del SENT[:-5000]
    return timed_send


def _watch_blocking_calls() -> None:
    """Suspects of a loop that stalls: the flock around sglang's load snapshot, log records written
    into a full pipe, and coroutines that wait to be started."""
    import asyncio
    import fcntl
    import logging

    fcntl.flock = _timed(fcntl.flock, "fcntl.flock")
    logging.StreamHandler.emit = _timed(logging.StreamHandler.emit, "a log record's write")
    asyncio.run_coroutine_threadsafe = _handed(asyncio.run_coroutine_threadsafe)
    from multiprocessing.connection import Connection

    Connection.send = _sent(Connection.send)


if os.environ.get(DIR_ENV):
    signal.signal(signal.SIGUSR2, _dump)
    _watch_blocking_calls()
