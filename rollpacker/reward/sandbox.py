"""Run one untrusted Python program on one input, confined.

The program runs in its own interpreter process, in its own session (so its
whole process group is killed on timeout), in a fresh temporary working
directory, with a minimal environment (no inherited secrets), CPU-time,
address-space, file-size and process-count rlimits, a private network
namespace when the kernel allows it, a parent-death signal, and, when we run
as root and the sandbox uid can execute the interpreter, a dropped uid.
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
from dataclasses import dataclass
from pathlib import Path

from rollpacker.reward import sandbox_boot

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_BOOT_SOURCE = Path(sandbox_boot.__file__).read_text()
_READ_CHUNK = 1 << 16

RUN_OK, RUN_TIMEOUT, RUN_VIOLATION, RUN_CRASH = "ok", "timeout", "violation", "crash"


@dataclass(frozen=True)
class SandboxLimits:
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_processes: int = 16
    output_limit_bytes: int = 1 << 20
    uid: int | None = None  # run as this uid (needs root); None keeps ours


@dataclass(frozen=True)
class RunResult:
    status: str  # RUN_OK | RUN_TIMEOUT | RUN_VIOLATION | RUN_CRASH
    stdout: str
    seconds: float
    detail: str = ""


def usable_uid(uid: int | None) -> int | None:
    """``uid`` if we are root and that uid can start the interpreter, else None.

    A dropped uid cannot read an interpreter installed under a private home
    (e.g. /root/.pyenv), so probe once instead of failing every sample.
    """
    if uid is None or os.geteuid() != 0:
        return None
    try:
        subprocess.run([sys.executable, "-I", "-c", "pass"], env=_environment("/"),
                       preexec_fn=lambda: _drop_uid(uid), capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return uid


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
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT_SOURCE], stdin=stdin_file, stdout=subprocess.PIPE,
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
    if returncode == -signal.SIGXFSZ:
        return RunResult(RUN_VIOLATION, "", seconds, f"file size limit of {limits.file_size_mb} MB exceeded")
    if returncode != 0:
        tail = err.strip().splitlines()[-1] if err.strip() else ""
        return RunResult(RUN_CRASH, "", seconds, f"exit status {returncode}: {tail}"[:500])
    return RunResult(RUN_OK, stdout.decode("utf-8", "replace"), seconds)
