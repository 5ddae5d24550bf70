"""Run one untrusted Python program on one input, confined.

The program runs in its own interpreter process, in its own session (so its
whole process group is killed on timeout), in a fresh temporary working
directory, with a minimal environment (no inherited secrets), CPU-time,
address-space, file-size and process-count rlimits, a private network
namespace when the kernel allows it, and a parent-death signal.  When we run
as root, it also either runs as an unprivileged uid (if that uid can execute
the interpreter) or, staying root, as PID 1 of its own PID and mount namespace
with its own /proc, where no host process can be seen, signalled or read.
Inside, ``sandbox_boot`` adds a policy hook.  Output is read with a cap; a
program that prints past it is killed.
"""
from __future__ import annotations

import ctypes
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from rollpacker.reward import sandbox_boot

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_BOOT_SOURCE = Path(sandbox_boot.__file__).read_text()
_READ_CHUNK = 1 << 16
# util-linux: the program becomes PID 1 of a fresh PID namespace with its own /proc;
# everything it starts dies with it, and --kill-child ties its life to the wrapper's.
_PID_NAMESPACE = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")

RUN_OK, RUN_TIMEOUT, RUN_VIOLATION, RUN_CRASH = "ok", "timeout", "violation", "crash"


@dataclass(frozen=True)
class SandboxLimits:
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_processes: int = 16
    output_limit_bytes: int = 1 << 20
    uid: int | None = None  # run as this uid (needs root); None keeps ours
    pid_namespace: bool = False  # run as PID 1 of a private PID + mount namespace (needs root)


@dataclass(frozen=True)
class RunResult:
    status: str  # RUN_OK | RUN_TIMEOUT | RUN_VIOLATION | RUN_CRASH
    stdout: str
    seconds: float
    detail: str = ""


def resolve_isolation(limits: SandboxLimits) -> SandboxLimits:
    """What this host allows, probed once per worker rather than failing every sample.

    A dropped uid cannot read an interpreter installed under a private home
    (e.g. /root/.pyenv); a program that stays root gets the namespaces instead.
    """
    if os.geteuid() != 0:
        return replace(limits, uid=None, pid_namespace=False)
    if limits.uid is not None and _starts(lambda: _drop_uid(limits.uid)):
        return replace(limits, pid_namespace=False)
    return replace(limits, uid=None, pid_namespace=_starts(None, _PID_NAMESPACE))


def _starts(preexec_fn: Callable[[], None] | None, prefix: tuple[str, ...] = ()) -> bool:
    try:
        subprocess.run([*prefix, sys.executable, "-I", "-c", "pass"], env=_environment("/"),
                       preexec_fn=preexec_fn, capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def run_python(source: str, stdin: str, timeout: float, limits: SandboxLimits) -> RunResult:
    workdir = tempfile.mkdtemp(prefix="rollpacker-sandbox-")
    try:
        Path(workdir, "solution.py").write_text(source, encoding="utf-8")
        stdin_path = Path(workdir, "stdin.txt")
        stdin_path.write_text(stdin, encoding="utf-8")
        if limits.uid is not None:
            for path in (workdir, *Path(workdir).iterdir()):
                os.chown(path, limits.uid, limits.uid)
        with open(stdin_path, "rb") as stdin_file:
            start = time.monotonic()
            prefix = _PID_NAMESPACE if limits.pid_namespace else ()
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-c", _BOOT_SOURCE], stdin=stdin_file, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=workdir, env=_environment(workdir), start_new_session=True,
                preexec_fn=lambda: _confine(limits, timeout), close_fds=True)
            try:
                stdout, stderr, cut = _collect(proc, start + timeout, limits.output_limit_bytes)
            finally:
                _kill_group(proc.pid)  # leftovers of a program that exited on its own
                proc.wait()
            seconds = time.monotonic() - start
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _classify(proc.returncode, stdout, stderr, cut, seconds, limits)


def _environment(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _drop_uid(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _confine(limits: SandboxLimits, timeout: float) -> None:
    """Runs in the child between fork and exec."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the worker
    if os.geteuid() == 0:
        _LIBC.unshare(_CLONE_NEWNET)  # best effort: a loopback-only, down network
    cpu = math.ceil(timeout) + 1
    for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, limits.memory_mb << 20),
                         (resource.RLIMIT_FSIZE, limits.file_size_mb << 20),
                         (resource.RLIMIT_NPROC, limits.max_processes), (resource.RLIMIT_CORE, 0)):
        hard = value + 1 if which == resource.RLIMIT_CPU else value  # SIGXCPU first, SIGKILL a second later
        resource.setrlimit(which, (value, hard))
    if limits.uid is not None:
        _drop_uid(limits.uid)


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str]:
    """Read stdout/stderr until both close, the deadline passes or stdout exceeds ``cap``.

    Returns (stdout, stderr tail, cut) with cut "" (ran to the end), "timeout" or "output".
    """
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), bytes(err), RUN_TIMEOUT
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, _READ_CHUNK)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if len(out) > cap:
                    return bytes(out[:cap]), bytes(err), "output"
                del err[:-4096]  # only the tail of stderr is kept, for the failure detail
    try:
        proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return bytes(out), bytes(err), RUN_TIMEOUT
    return bytes(out), bytes(err), ""


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(returncode: int, stdout: bytes, stderr: bytes, cut: str, seconds: float,
              limits: SandboxLimits) -> RunResult:
    err = stderr.decode("utf-8", "replace")
    if cut == RUN_TIMEOUT or returncode == -signal.SIGXCPU:
        return RunResult(RUN_TIMEOUT, "", seconds, "time limit exceeded")
    if cut == "output":
        return RunResult(RUN_VIOLATION, "", seconds, f"output exceeded {limits.output_limit_bytes} bytes")
    if returncode == sandbox_boot.VIOLATION_EXIT and sandbox_boot.VIOLATION_MARK in err:
        return RunResult(RUN_VIOLATION, "", seconds, err.rsplit(sandbox_boot.VIOLATION_MARK, 1)[1].strip())
    if returncode != 0:
        tail = err.strip().splitlines()[-1] if err.strip() else ""
        return RunResult(RUN_CRASH, "", seconds, f"exit status {returncode}: {tail}"[:500])
    return RunResult(RUN_OK, stdout.decode("utf-8", "replace"), seconds)
