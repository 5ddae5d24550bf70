"""A wake-up another thread can send to one that sleeps in a poll: a pipe whose read end joins the
sleeper's poll set.

Used where a thread waits on sockets or pipes and must also hear of work handed over in memory: the
coordinator's news inbox (a score came), the stream feeder (a group was kept) and the reward pool's
dispatcher (a response was submitted). One byte is written per sleep, not per wake: a flag says one
already waits in the pipe. The sleeper drains the pipe before it lowers the flag and only then looks
at what the wakers handed over; in the other order a wake landing in between could leave the flag up
over an empty pipe, and every later wake would be skipped.
"""
from __future__ import annotations

import os
import threading


class Wakeup:
    def __init__(self) -> None:
        self.fd, self._w = os.pipe()  # poll ``fd`` for reading beside whatever else the sleeper waits on
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._pending = False  # a byte waits in the pipe
        # a late waker (a score of a past round) may call ``wake`` while the owner closes: it must not
        # write to a closed descriptor, or to the file that took its number
        self._lock = threading.Lock()
        self._closed = False

    def wake(self) -> None:
        """Make the sleeper's poll (or its next one) return; safe from any thread, and after close."""
        if self._pending:
            return
        self._pending = True
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def drain(self) -> None:
        """The sleeper, once ``fd`` polled readable, before it looks at what the wakers handed over."""
        try:
            os.read(self.fd, 1 << 16)
        except BlockingIOError:
            pass
        self._pending = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self.fd)
            os.close(self._w)
