"""The pool's failure handling: killed and hung workers, retries, back-pressure, bad input."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from rollpacker.reward import RewardConfig, RewardPool
from testkit import REPO_ROOT

SLEEPY = "```python\nimport time\ntime.sleep({seconds})\nprint('done')\n```"
DONE = [{"stdin": "", "stdout": "done"}]


def sleepy(seconds: float) -> str:
    return SLEEPY.format(seconds=seconds)


@pytest.fixture
def pool():
    cfg = RewardConfig(num_workers=1, queue_size=1, code_t_max=3.0, worker_grace=1.0)
    with RewardPool(cfg) as p:
        assert p.wait_ready(60)
        yield p


def wait_busy(pool: RewardPool, not_pid: int | None = None) -> int:
    """The pid of the worker once it is scoring a sample (and is not ``not_pid``)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = pool.stats()
        if stats.in_flight == 1 and stats.worker_pids[0] != not_pid:
            time.sleep(0.2)  # let the worker start the sandboxed program
            return stats.worker_pids[0]
        time.sleep(0.02)
    raise AssertionError(f"the worker never picked up the sample: {pool.stats()}")


def test_killed_worker_is_replaced_and_its_sample_retried(pool):
    future = pool.submit("code", sleepy(1.0), DONE)
    victim = wait_busy(pool)
    os.kill(victim, signal.SIGKILL)
    score = future.result(timeout=30)
    assert score.reason == "ok" and score.reward == 1.0
    stats = pool.stats()
    assert stats.workers_alive == 1 and stats.workers_replaced == 1 and stats.retried == 1
    assert victim not in stats.worker_pids


def test_sample_whose_worker_dies_twice_is_a_crash(pool):
    future = pool.submit("code", sleepy(1.0), DONE)
    first = wait_busy(pool)
    os.kill(first, signal.SIGKILL)
    os.kill(wait_busy(pool, not_pid=first), signal.SIGKILL)
    score = future.result(timeout=30)
    assert (score.reason, score.reward) == ("crash", 0.0), score
    assert pool.stats().workers_replaced == 2
    assert pool.wait_ready(30)
    assert pool.submit("stepchain", "Answer: 3", "3").result(timeout=30).correct  # still serving


def test_hung_worker_is_killed_after_its_budget_and_the_sample_retried(pool):
    future = pool.submit("code", sleepy(0.5), DONE)
    victim = wait_busy(pool)
    os.kill(victim, signal.SIGSTOP)  # hung: alive but never answers
    score = future.result(timeout=30)
    assert score.reason == "ok"
    # the hung attempt counts: it ran its full budget (T_max + grace) before the retry
    assert score.seconds >= 3.0 + 1.0
    assert not os.path.exists(f"/proc/{victim}") or open(f"/proc/{victim}/stat").read().split()[2] == "Z"
    assert pool.stats().workers_replaced == 1


PR_SET_CHILD_SUBREAPER = 36


MARKED = "```python\nimport time\nopen('started', 'w').close()\ntime.sleep({seconds})\nprint('done')\n```"


def marked_program(worker: int) -> tuple[int, str]:
    """Pid and working directory of the MARKED program that ``worker`` runs, once the program runs
    (the worker has reported it to the pool by then)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            for child in psutil.Process(worker).children():
                if os.path.exists(os.path.join(child.cwd(), "started")):
                    return child.pid, child.cwd()
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.02)
    raise AssertionError(f"worker {worker} never started the program")


def zombie_children() -> list[int]:
    zombies = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                zombies.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return zombies


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_replaced_worker_leaves_no_program_zombie_or_directory(pool, how):
    """What a worker would clean up after its program falls to the pool when the worker is killed
    mid-run (SIGKILL here; SIGSTOP: the pool kills it at its deadline): the program's working
    directory is removed, and the program is killed and reaped even where orphans come back to this
    process (as to a trainer that is a container's PID 1; here this process is a child subreaper)."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    try:
        future = pool.submit("code", MARKED.format(seconds=1.0 if how == signal.SIGKILL else 0.5), DONE)
        worker = wait_busy(pool)
        program, workdir = marked_program(worker)
        os.kill(worker, how)
        score = future.result(timeout=30)
        assert score.reason == "ok"  # retried once on a fresh worker, as the pool promises
        stats = pool.stats()
        assert stats.workers_replaced == 1 and stats.retried == 1 and worker not in stats.worker_pids
        assert not os.path.exists(workdir) and not os.path.exists(os.path.dirname(workdir))
        assert not psutil.pid_exists(program)  # killed and reaped, not a zombie of anyone
        assert zombie_children() == []
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0)


def test_workers_remove_their_scratch_directories_when_the_pools_process_is_killed(tmp_path):
    """A trainer killed with SIGKILL cannot close its pool: each worker sees its pipe close and
    removes the scratch directory the pool made for it."""
    owner = ("import time\nfrom rollpacker.reward import RewardConfig, RewardPool\n"
             "pool = RewardPool(RewardConfig(num_workers=2))\nassert pool.wait_ready(60)\n"
             "print('ready', flush=True)\ntime.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", owner], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert proc.stdout.readline() == b"ready\n"
        assert len(list(tmp_path.glob("rollpacker-reward-*"))) == 2
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while list(tmp_path.glob("rollpacker-reward-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob("rollpacker-reward-*")) == []


def test_a_process_that_crashes_without_close_ends_its_workers_quietly(tmp_path):
    """Rank 0 raising (e.g. a peer died) never reaches ``close()``. Exiting, the interpreter ends
    the workers; the pool must not take that for crashes and restart them into a dying process
    (it logged "replacing it" and "reward dispatcher failed" over the error that mattered)."""
    owner = ("from rollpacker.reward import RewardConfig, RewardPool\n"
             "pool = RewardPool(RewardConfig(num_workers=2))\nassert pool.wait_ready(60)\n"
             "print(*pool.stats().worker_pids, flush=True)\nraise RuntimeError('the error that matters')")
    proc = subprocess.run([sys.executable, "-c", owner], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=120)
    assert proc.returncode == 1 and "the error that matters" in proc.stderr
    assert "replacing it" not in proc.stderr and "dispatcher failed" not in proc.stderr, proc.stderr
    workers = [int(pid) for pid in proc.stdout.split()]
    assert len(workers) == 2 and not any(psutil.pid_exists(pid) for pid in workers)
    assert list(tmp_path.glob("rollpacker-reward-*")) == []


def test_submit_blocks_while_the_queue_is_full(pool):
    first = pool.submit("code", sleepy(1.0), DONE)
    wait_busy(pool)
    queued = pool.submit("stepchain", "Answer: 1", "1")  # fills the one-slot queue
    third: list = []
    blocked = threading.Thread(target=lambda: third.append(pool.submit("stepchain", "Answer: 2", "2")))
    blocked.start()
    time.sleep(0.4)
    assert blocked.is_alive() and not first.done()  # back-pressure, not an unbounded buffer
    blocked.join(timeout=30)
    assert [f.result(timeout=30).correct for f in (first, queued, third[0])] == [True, True, True]


def test_bad_input_is_refused_by_name(pool):
    with pytest.raises(ValueError, match="no scorer for data_source 'poetry'"):
        pool.submit("poetry", "x", "y")
    with pytest.raises(ValueError, match="code test 1 must be"):
        pool.submit("code", "x", [{"stdin": "", "stdout": ""}, {"stdin": 3}])
    with pytest.raises(ValueError, match="needs an LLM judge"):
        pool.submit("judge", "x", "y")


def test_close_finishes_submitted_work_then_refuses():
    cfg = RewardConfig(num_workers=2)
    pool = RewardPool(cfg)
    futures = [pool.submit("stepchain", f"Answer: {i}", str(i % 2)) for i in range(20)]
    pool.close()
    assert [f.result(timeout=0).correct for f in futures] == [i % 2 == i for i in range(20)]
    with pytest.raises(RuntimeError, match="after close"):
        pool.submit("stepchain", "Answer: 1", "1")


class DecodeOrDie:
    """A tokenizer double for the workers: token ids [k] * n decode to a math answer n, and the
    id 13 kills the worker decoding it (a worker that dies in the middle of a batch)."""

    def decode(self, ids, skip_special_tokens=True):
        if 13 in ids:
            os._exit(3)
        return f"so the answer is \\boxed{{{len(ids)}}}"


def test_a_worker_that_dies_mid_batch_costs_only_the_culprit_an_attempt():
    """Responses sent as token ids are decoded in the workers; the worker dies on one sample of a
    batch: the batch's samples are rescored alone, no attempt spent, and only the culprit is retried
    (then scored a crash); every other sample is scored correctly."""
    with RewardPool(RewardConfig(num_workers=1, worker_grace=5.0), tokenizer=DecodeOrDie()) as pool:
        assert pool.wait_ready(60)
        futures = [pool.submit("math", [7] * n, str(n)) for n in range(1, 11)]
        killer = pool.submit("math", [13], "1")
        futures += [pool.submit("math", [7] * n, str(n)) for n in range(11, 31)]
        scores = [f.result(timeout=60) for f in futures]
        crash = killer.result(timeout=60)
        stats = pool.stats()
    print(f"30 samples as token ids: {sum(s.correct for s in scores)} correct; the killer: {crash.reason} "
          f"({crash.detail}); workers replaced {stats.workers_replaced}, retried {stats.retried}")
    assert all(s.correct and s.reason == "ok" for s in scores)
    assert crash.reason == "crash" and "both attempts" in crash.detail
    # two deaths of the culprit alone, and one more if it was first sent in a batch with others
    assert stats.retried == 1 and 2 <= stats.workers_replaced <= 3 and stats.workers_alive == 1


def test_token_ids_need_a_pool_with_a_tokenizer():
    with RewardPool(RewardConfig(num_workers=1)) as pool:
        with pytest.raises(ValueError, match="tokenizer"):
            pool.submit("math", [1, 2, 3], "6")


def test_a_worker_of_the_training_program_does_not_import_its_trainer():
    """A forkserver (or spawn) child first runs the parent's main module as ``__mp_main__``
    (``multiprocessing.spawn._fixup_main_from_name``: ``runpy.run_module``). Under ``python -m
    rollpacker.train`` every reward worker does so with ``rollpacker.train``: with torch, Megatron and
    transformers at its top, each worker spent about 5 CPU seconds and 370 MB before its first score,
    and the first round waited for it. Done here as multiprocessing does it, in a fresh interpreter."""
    # the resident set now (VmRSS): ru_maxrss would report the parent's peak, which Linux carries over a fork
    probe = ("import re, runpy, sys; runpy.run_module('rollpacker.train', run_name='__mp_main__', alter_sys=True); "
             "print(sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules), "
             "int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) // 1024)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr
    heavy, rss_mb = out.stdout.rsplit(" ", 1)
    print(f"modules a worker imports from the entry point: {heavy}; resident {rss_mb} MB")
    assert heavy == "[]" and int(rss_mb) < 100
