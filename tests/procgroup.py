"""Ending a process group a test started, and nothing else."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def kill_group(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGKILL the process group ``proc`` leads (a session it was started in), then reap ``proc``.

    Until ``proc`` is reaped its pid names this group alone. Once reaped, the group lives on only in
    what is left of it (the reward workers of a rank killed by -9), and with nothing left the kernel
    may give the pid to a new process, perhaps the leader of another test's group (an engine host):
    a live process with that pid is not ours, and its group is left alone."""
    if proc.returncode is not None:
        try:
            os.kill(proc.pid, 0)
            return  # the pid is another process's now; anything left of ours would have kept it
        except ProcessLookupError:
            pass
        except PermissionError:
            return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode is None:
        proc.wait(timeout=timeout)
