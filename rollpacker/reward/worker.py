"""The scoring worker process: receives batches of jobs over a pipe, answers with their outcomes.

A worker is started by the pool with the "forkserver" or "spawn" context, never
by forking the trainer.  It makes itself a session leader at once so that the
pool can kill it together with anything it started (``os.killpg(pid)``), and
it announces readiness only after its heavy imports, so that a job's deadline
never pays for interpreter start-up.
"""
from __future__ import annotations

import array
import dataclasses
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from rollpacker.reward.sandbox import SandboxLimits, resolve_isolation
from rollpacker.reward.score import ERROR, Score
from rollpacker.reward.scorers import CODE, MATH, STEPCHAIN

READY = "ready"
PROGRAM = "program"  # (PROGRAM, pid): a job started this sandboxed program
# Outcomes are sent as lists, at most this long after the first of them: one message (one wake-up of
# the pool's dispatcher, in the trainer's process) per many fast samples, a score late by at most this.
_FLUSH_S = 0.02


@dataclass(frozen=True)
class Job:
    scorer: str  # MATH | STEPCHAIN | CODE
    response: str | array.array  # the text, or its token ids ('i'), which the worker decodes
    label: Any  # ground-truth string, or parsed code test cases
    timeouts: tuple[float, ...] = ()  # code: one per test case


@dataclass(frozen=True)
class Outcome:
    score: Score
    passed_case_seconds: dict[int, float]  # code: runtimes of the cases the program passed
    seconds: float = 0.0  # the job's time on the worker


@dataclass(frozen=True)
class WorkerSettings:
    math_timeout: float
    limits: SandboxLimits
    tokenizer: Any = None  # decodes responses sent as token ids (``RewardPool(..., tokenizer=)``)
    math_extract: str = "boxed"  # ``reward.math_extract``: which part of a response is its answer


def worker_main(conn: Connection, settings: WorkerSettings) -> None:
    os.setsid()
    from rollpacker.reward.scorers.math_answer import score_math

    score_math("\\boxed{1}", "1", settings.math_timeout)  # sympy's first use is slow: pay it before READY
    settings = dataclasses.replace(settings, limits=resolve_isolation(settings.limits))
    conn.send(READY)
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the pool is gone
            break
        if message is None:
            break
        outcomes: list[tuple[int, Outcome]] = []
        sent_at = time.monotonic()

        def flush() -> None:
            nonlocal outcomes, sent_at
            if outcomes:
                conn.send(outcomes)
            outcomes, sent_at = [], time.monotonic()

        def on_start(pid: int) -> None:  # after the outcomes before it: an outcome clears the program
            flush()
            conn.send((PROGRAM, pid))

        for job_id, job in message:  # a batch: outcomes go back together, at least every _FLUSH_S
            started = time.monotonic()
            outcome = run_job(job, settings, on_start=on_start)
            outcomes.append((job_id, dataclasses.replace(outcome, seconds=time.monotonic() - started)))
            if time.monotonic() - sent_at >= _FLUSH_S:
                flush()
        flush()
    # The pool removes the scratch directory of a worker it stops, but a pool killed with its process
    # (a trainer's SIGKILL) cannot: the worker, which sees the pipe close, removes it then.
    if settings.limits.scratch_root is not None:
        shutil.rmtree(settings.limits.scratch_root, ignore_errors=True)


def run_job(job: Job, settings: WorkerSettings, on_start: Callable[[int], None] | None = None) -> Outcome:
    """Score one job; a scorer's own failure is an ERROR score, never a dead worker."""
    try:
        if not isinstance(job.response, str):
            text = settings.tokenizer.decode(job.response.tolist(), skip_special_tokens=True)
            job = dataclasses.replace(job, response=text)
        if job.scorer == MATH:
            from rollpacker.reward.scorers.math_answer import score_math
            return Outcome(score_math(job.response, job.label, settings.math_timeout, settings.math_extract), {})
        if job.scorer == STEPCHAIN:
            from rollpacker.reward.scorers.stepchain import score_stepchain
            return Outcome(score_stepchain(job.response, job.label), {})
        if job.scorer == CODE:
            from rollpacker.reward.scorers.code import score_code
            score, passed = score_code(job.response, job.label, job.timeouts, settings.limits, on_start)
            return Outcome(score, passed)
        raise ValueError(f"worker has no scorer {job.scorer!r}")
    except Exception:  # noqa: BLE001 - any scorer bug must come back as a score
        return Outcome(Score.failed(ERROR, traceback.format_exc(limit=3)[-500:]), {})
