"""Suite-wide rules and the SGLang CPU venv.

- Under ``CI=true`` a skipped test fails the run, unless it is listed below with why. A skip in CI
  means a check the README relies on did not run; pytest reports it as a pass-with-note (``-ra``
  prints it), which a green CI run hides. Only skips whose cause CI cannot remove are allowed.
- Under ``-n 2`` (the README's command) files go whole to the next free worker in collection order
  (``--dist loadfile --no-loadscope-reorder``, pytest.ini), so the longest files are collected first:
  a run then does not end on one of them while the other worker idles. Each worker, and what it
  starts, computes on one thread (``OMP_NUM_THREADS=1``): a thread team spread over both cores waits
  on whichever of its threads the other worker's processes preempt (a 2-thread sampling test ran 6x
  slower beside another file). SGLang's engines bind their own threads (``sglang_args.cpu_engine_env``).
- The tests that run the real SGLang engine take the ``sglang_venv_python`` fixture. When any of
  them is collected, the venv's build (or the check that it is current) starts in the background at
  once (``tests/sglang_cpu/env.py``) and overlaps the tests before them. After it, the build of the
  GPU machine's package set and the SGLang bundle (``tests/sglang_gpu/env.py``) for the test that
  takes ``sglang_gpu_bundle``.
"""
from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from testkit import kill_group
from tests.sglang_cpu.env import CACHE, build_in_background, sglang_python
from tests.sglang_gpu import env as sglang_gpu_env

# node id prefix -> why CI may skip it
ALLOWED_CI_SKIPS = {
    "tests/integration/test_trl_bench.py":
        "TRL is not a dependency: its comparison runs only where a user installed trl",
}

# the files of over a minute, longest first (``--durations`` of a sequential clean-clone run: 453, 180,
# 262, 205, 121, 100, 90, 76, 58, 45 s); the second is not an SGLang one, so that one worker has work
# while the first waits for the venv's build; test_sglang_gpu_bundle.py (45-70 s once built) goes where
# its background build (1.5 minutes from nothing on an idle machine, about 5 beside the first files) is done
LONGEST_FIRST = ("test_sglang_real.py", "test_train_program.py", "test_multinode_procs.py", "test_gpu_acceptance.py",
                 "test_resume_shipped.py", "test_stale_sync.py", "test_eval_procs.py", "test_slurm_launch.py",
                 "test_sglang_gpu_bundle.py", "test_console.py", "test_own_model.py", "test_package.py",
                 "test_checkpoint_faults_procs.py", "test_policy_quality_slow.py")

if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)

_skipped: list[tuple[str, str]] = []
_venv_build: list[subprocess.Popen] = []
_build_lock = threading.Lock()
_session_over = False


@pytest.fixture(scope="session")
def sglang_venv_python() -> Path:
    return sglang_python()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: the SGLang files' venv build overlaps the rest
        return
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest keep their order


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    fixtures = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    builds = [(start, log) for fixture, start, log in (
        ("sglang_venv_python", build_in_background, CACHE / "background-build.log"),
        ("sglang_gpu_bundle", sglang_gpu_env.build_in_background, sglang_gpu_env.CACHE / "background-build.log"))
        if fixture in fixtures]
    threading.Thread(target=_build_in_turn, args=(builds,), name="venv-builds", daemon=True).start()


def _build_in_turn(builds: list) -> None:
    """The builds one after another, the CPU venv first: its tests run first, and with both at once (each
    installing gigabytes) the CPU venv's build took 886 s instead of about 100 on 2 cores. Each is waited
    for, so reaped as soon as it ends: a finished child left unwaited is a zombie of this process, which
    tests that count this process's zombies would see (tests/integration/test_reward_pool.py)."""
    for start, log in builds:
        with _build_lock:
            if _session_over:
                return
            proc = start(log)
            _venv_build.append(proc)
        proc.wait()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not any(report.nodeid.startswith(p) for p in ALLOWED_CI_SKIPS):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append((report.nodeid, reason))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _session_over
    with _build_lock:  # no build starts after this
        _session_over = True
    for proc in _venv_build:  # still building only if the run ended first (a build cut short leaves no stamp)
        if proc.poll() is None:
            kill_group(proc.pid)
        proc.wait()
    if os.environ.get("CI") == "true" and _skipped:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if os.environ.get("CI") == "true" and _skipped:
        terminalreporter.section("skips not allowed in CI (tests/conftest.py ALLOWED_CI_SKIPS)", red=True)
        for nodeid, reason in _skipped:
            terminalreporter.line(f"{nodeid}: {reason}")
