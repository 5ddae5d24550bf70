"""Run one untrusted Python program on one input, confined.

The program runs in its own interpreter process, in its own session (so its
whole process group is killed on timeout), in a fresh temporary working
directory, with a minimal environment (no inherited secrets), CPU-time,
address-space, file-size and process-count rlimits, no_new_privs, a private
network namespace when the kernel allows it, and a parent-death signal.
Inside, ``sandbox_boot`` adds an audit-hook policy layer.  Output is read with
a cap; a program that prints past it is killed.

Untrusted code never runs as uid 0.  When the worker is root, every program
runs as the configured unprivileged uid (``SandboxLimits.uid``, one per
worker), so the kernel limits bind even against code that defeats the audit
hook: RLIMIT_NPROC does not bind root but does bind that uid, and file
permissions stop writes outside the working directory.  If that cannot be
arranged, code is not run at all: ``run_python`` raises ``SandboxUnavailable``
(the scorer turns it into an ``error`` score) for a root worker with no uid,
and ``resolve_isolation`` probes the whole path once per worker and, if the
probe fails, records why, so that every later run is refused the same way.
Unprivileged workers already cannot escalate; they keep their own uid.

Reaching the interpreter as that uid.  A Python installed under a private
directory (``/root/.pyenv/versions/X`` with ``/root`` at mode 700) cannot be
executed by another uid, and copying it elsewhere does not work in general:
shared builds carry an absolute RUNPATH to their own ``lib``, venvs point at
their base, and copies go stale.  So, still root between fork and exec, the
child enters a private mount namespace (mounts made there vanish with it,
nothing on the host changes) and, for each directory it needs that has an
ancestor the uid cannot search, mounts an empty root-owned 0755 tmpfs over the
topmost such ancestor and bind-mounts the needed directory back at its own
path.  What it needs is the interpreter's installation (the real executable's
directory, ``sys.base_prefix``, ``sys.base_exec_prefix`` and, for shared
builds, the ``LIBDIR`` holding libpython), read-only, and the working
directory, writable.  Every path stays the same (RUNPATH, getpath's prefix
search and extension modules work unchanged, with any installation) and the
rest of the private ancestor (e.g. all of ``/root`` besides the installation)
is hidden instead of exposed; no capability such as CAP_DAC_READ_SEARCH is
granted.  A venv's base interpreter is run: programs need only the standard
library (the installation's own site-packages, inside its prefix, stay
visible read-only as they would be to any user of a system-wide Python; a
venv's do not).  When no ancestor blocks, no mount is needed for this.

Where the kernel allows it, the same namespace also gets, as defence in
depth: the whole mount tree read-only and nosuid (``mount_setattr``, Linux
5.12+) except the working directory, so world-writable places such as /tmp
refuse writes too; and a /proc of its own with ``hidepid=2``, so processes of
other uids cannot be seen.  After each run, every process the program left
(e.g. a child that left the session) is killed and reaped: the calling
process is a child subreaper while it runs a program, so none outlives its
sample or, as an unreaped zombie, eats the next one's process limit.

A worker killed mid-run (timeout, crash) cleans up nothing, so what it would
have cleaned belongs to its owner: every working directory is made inside
``SandboxLimits.scratch_root``, a directory the pool creates for the worker
and removes when it replaces it, and ``on_start`` reports each program's pid
so that the pool can kill the program's process group and reap what comes
back to it.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

from rollpacker.reward import sandbox_boot

log = logging.getLogger(__name__)
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20, 0x1000, 0x4000, 1 << 18
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture (Linux 5.12+)
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID = 0x1, 0x2
_BOOT_SOURCE = Path(sandbox_boot.__file__).read_text()
_READ_CHUNK = 1 << 16

RUN_OK, RUN_TIMEOUT, RUN_VIOLATION, RUN_CRASH = "ok", "timeout", "violation", "crash"
ROOT_WITHOUT_UID = ("refusing to run untrusted code as root: set reward.sandbox_uid to an unused "
                    "non-root uid so that sandboxed programs run unprivileged")


class SandboxUnavailable(RuntimeError):
    """Untrusted code cannot be run unprivileged here, so it is not run at all."""


@dataclass(frozen=True)
class SandboxLimits:
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_processes: int = 16
    output_limit_bytes: int = 1 << 20
    uid: int | None = None  # as root: run programs as this uid (required); unprivileged: ignored
    refusal: str | None = None  # set by resolve_isolation when programs cannot be run unprivileged
    scratch_root: str | None = None  # parent of each run's working directory (None: the system temp dir)


@dataclass(frozen=True)
class RunResult:
    status: str  # RUN_OK | RUN_TIMEOUT | RUN_VIOLATION | RUN_CRASH
    stdout: str
    seconds: float
    detail: str = ""


def resolve_isolation(limits: SandboxLimits) -> SandboxLimits:
    """Probe once per worker that programs really run as ``limits.uid``; otherwise refuse them all.

    The probe goes through ``run_python`` itself, so it exercises the very path samples take.
    """
    if os.geteuid() != 0:
        return replace(limits, uid=None, refusal=None)
    if not limits.uid:
        log.error("code scoring disabled: %s", ROOT_WITHOUT_UID)
        return replace(limits, refusal=ROOT_WITHOUT_UID)
    uid, limits = limits.uid, replace(limits, refusal=None)
    probe = "import os\nprint(*os.getresuid(), *os.getresgid(), len(os.getgroups()))"
    try:
        run = run_python(probe, "", 60.0, limits)
    except (OSError, subprocess.SubprocessError, SandboxUnavailable) as exc:
        detail = f"{type(exc).__name__}: {exc}"
    else:
        if run.status == RUN_OK and run.stdout.split() == [str(uid)] * 6 + ["0"]:
            return limits
        detail = f"{run.status}: {run.detail or run.stdout.strip()}"[:300]
    refusal = (f"refusing to run untrusted code: sandboxed programs cannot be started as uid {uid} here, "
               f"and they are never run as root ({detail})")
    log.error("code scoring disabled: %s", refusal)
    return replace(limits, refusal=refusal)


def run_python(source: str, stdin: str, timeout: float, limits: SandboxLimits,
               on_start: Callable[[int], None] | None = None) -> RunResult:
    """Run ``source`` on ``stdin``; ``on_start`` gets the program's pid (also its process group and
    session id) as soon as it exists."""
    if limits.refusal:
        raise SandboxUnavailable(limits.refusal)
    as_root = os.geteuid() == 0
    if as_root and not limits.uid:
        raise SandboxUnavailable(ROOT_WITHOUT_UID)
    uid = limits.uid if as_root else None
    if uid is None:
        return _run(source, stdin, timeout, limits, None, on_start)
    was_subreaper = ctypes.c_int(0)
    _LIBC.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was_subreaper))
    _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1)  # leftovers come back to us to be reaped: see _kill_leftovers
    try:
        return _run(source, stdin, timeout, limits, uid, on_start)
    finally:
        if not was_subreaper.value:  # the caller's own orphans go to init again
            _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 0)


def _run(source: str, stdin: str, timeout: float, limits: SandboxLimits, uid: int | None,
         on_start: Callable[[int], None] | None) -> RunResult:
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="rollpacker-sandbox-", dir=limits.scratch_root))
    try:
        Path(workdir, "solution.py").write_text(source, encoding="utf-8")
        stdin_path = Path(workdir, "stdin.txt")
        stdin_path.write_text(stdin, encoding="utf-8")
        if uid is not None:
            for path in (workdir, *Path(workdir).iterdir()):
                os.chown(path, uid, uid)
            covers = _covers([(root, False) for root in _interpreter_roots()] + [(workdir, True)], uid)
            executable = os.path.realpath(sys.executable)
        else:
            covers, executable = {}, sys.executable
        with open(stdin_path, "rb") as stdin_file:
            start = time.monotonic()
            proc = subprocess.Popen(
                [executable, "-I", "-c", _BOOT_SOURCE], stdin=stdin_file, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=workdir, env=_environment(workdir), start_new_session=True,
                preexec_fn=lambda: _confine(limits, uid, timeout, workdir, covers), close_fds=True)
            try:
                if on_start is not None:
                    on_start(proc.pid)
                stdout, stderr, cut = _collect(proc, start + timeout, limits.output_limit_bytes)
            finally:
                _kill_group(proc.pid)  # leftovers of a program that exited on its own
                proc.wait()
                if uid is not None:
                    _kill_leftovers(uid)  # leftovers that left the process group
            seconds = time.monotonic() - start
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _classify(proc.returncode, stdout, stderr, cut, seconds, limits)


def _environment(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@lru_cache(maxsize=1)
def _interpreter_roots() -> tuple[str, ...]:
    """The directories the interpreter needs: its executable's, its prefixes and libpython's."""
    roots = {os.path.dirname(os.path.realpath(sys.executable)), os.path.realpath(sys.base_prefix),
             os.path.realpath(sys.base_exec_prefix)}
    libdir = sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir:
        roots.add(os.path.realpath(libdir))
    return tuple(sorted(r for r in roots if not any(r.startswith(o.rstrip("/") + "/") for o in roots if o != r)))


def _searchable(path: str, uid: int) -> bool:
    """Whether ``uid`` (gid ``uid``, no supplementary groups) may traverse the directory ``path``."""
    st = os.stat(path)
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == uid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _covers(exposures: list[tuple[str, bool]], uid: int) -> dict[str, list[tuple[str, bool]]]:
    """cover -> [(path, writable)]: the topmost ancestor of each path that ``uid`` cannot search.

    Paths with no such ancestor need nothing and are left out.
    """
    covers: dict[str, list[tuple[str, bool]]] = {}
    for path, writable in exposures:
        parts = Path(path).parts
        for depth in range(2, len(parts)):
            ancestor = os.path.join(*parts[:depth])
            if not _searchable(ancestor, uid):
                covers.setdefault(ancestor, []).append((path, writable))
                break
    return covers


def _drop_uid(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else os.fsencode(s))
    if _LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _isolate_filesystem(workdir: str, covers: dict[str, list[tuple[str, bool]]]) -> None:
    """Runs in the child, as root, between fork and exec: see the module docstring."""
    if _LIBC.unshare(_CLONE_NEWNS) != 0:
        if covers:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
        return  # nothing needs exposing; the defence-in-depth mounts are skipped
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates back to the host
    # hold each exposed directory by an fd before its ancestor is covered, then bind it back from that fd
    held = {path: os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            for exposures in covers.values() for path, _ in exposures}
    try:
        for cover, exposures in covers.items():
            _mount("tmpfs", cover, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "mode=755,size=64k,nr_inodes=256")
            for path, writable in exposures:
                at = cover
                for part in Path(os.path.relpath(path, cover)).parts:
                    at = os.path.join(at, part)
                    if not os.path.isdir(at):
                        os.mkdir(at)
                        os.chmod(at, 0o755)
                _mount(f"/proc/self/fd/{held[path]}", path, None, _MS_BIND | _MS_REC)
                if not writable:
                    _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
            _mount(None, cover, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    finally:
        for fd in held.values():
            os.close(fd)
    try:  # a /proc of our own, in which processes of other uids are invisible
        _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
    except OSError:
        pass
    attr = _MountAttr(attr_set=_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID)
    if _LIBC.syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(_AT_FDCWD), b"/",
                     ctypes.c_uint(_AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))) == 0:
        _mount(workdir, workdir, None, _MS_BIND)  # everything is read-only now but the working directory
        _mount(None, workdir, None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID | _MS_NODEV)
    os.chdir(workdir)  # subprocess entered it before these mounts: enter what lies at that path now


def _confine(limits: SandboxLimits, uid: int | None, timeout: float, workdir: str,
             covers: dict[str, list[tuple[str, bool]]]) -> None:
    """Runs in the child between fork and exec."""
    if uid is not None:
        _LIBC.unshare(_CLONE_NEWNET)  # best effort: a loopback-only, down network
        _isolate_filesystem(workdir, covers)
    cpu = math.ceil(timeout) + 1
    for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, limits.memory_mb << 20),
                         (resource.RLIMIT_FSIZE, limits.file_size_mb << 20),
                         (resource.RLIMIT_NPROC, limits.max_processes), (resource.RLIMIT_CORE, 0)):
        hard = value + 1 if which == resource.RLIMIT_CPU else value  # SIGXCPU first, SIGKILL a second later
        resource.setrlimit(which, (value, hard))
    if uid is not None:
        _drop_uid(uid)
    if os.geteuid() == 0 or os.getuid() == 0:  # never exec untrusted code as root
        raise SandboxUnavailable(ROOT_WITHOUT_UID)
    _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries cannot raise privileges
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the worker (set after the uid change clears it)


def _kill_leftovers(uid: int, patience: float = 2.0) -> None:
    """Kill and reap every process of ``uid`` that descends from this one, after its program exited.

    A leftover that left the program's session escapes the group kill; this process being a child
    subreaper, it is still a descendant (orphans come back here, not to init).  Reaping them here
    matters too: a zombie left to an init that never reaps (e.g. a trainer running as PID 1 of a
    container) would count against the uid's process limit forever.  Only descendants are touched,
    so other pools' programs running as the same uid are not.
    """
    deadline = time.monotonic() + patience
    while True:
        victims = _descendants_of_uid(uid)
        if not victims or time.monotonic() > deadline:
            return
        for pid in victims:
            _kill_if_uid(pid, uid)
        for pid in victims:
            try:
                os.waitpid(pid, os.WNOHANG)  # ours once its parent died; others are reaped next round
            except ChildProcessError:
                pass
        time.sleep(0.002)


def _kill_if_uid(pid: int, uid: int) -> None:
    """SIGKILL ``pid`` if it still is a process of ``uid`` (checked through a pidfd, so a pid reused
    meanwhile by some other process is never signalled)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone (or a kernel before 5.3: then the check below and kill by pid)
        pidfd = None
        if not os.path.exists(f"/proc/{pid}"):
            return
    try:
        if _real_uid(pid) != uid:
            return
        if pidfd is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (OSError, ValueError):
        pass  # gone meanwhile
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _descendants_of_uid(uid: int) -> list[int]:
    """Processes of ``uid`` (zombies included) below this one, through processes of ``uid`` only."""
    children = _children_reader()
    found, frontier = [], [os.getpid()]
    while frontier:
        pid = frontier.pop()
        for child in children(pid):
            try:
                if _real_uid(child) == uid:
                    found.append(child)
                    frontier.append(child)
            except (OSError, ValueError):
                continue  # gone meanwhile
    return found


def _children_reader() -> Callable[[int], list[int]]:
    """pid -> its children: from /proc/PID/task/*/children where the kernel has them, else one scan."""
    if os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children"):
        def children(pid: int) -> list[int]:
            found = []
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                        found.extend(int(c) for c in f.read().split())
            except OSError:
                pass
            return found
        return children
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            by_parent.setdefault(ppid, []).append(int(entry))
    return lambda pid: by_parent.get(pid, [])


def _real_uid(pid: int) -> int:
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Uid:"):
                return int(line.split()[1])
    raise ValueError(pid)


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
