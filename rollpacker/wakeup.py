"""How a thread of the control plane sleeps: ``Waiter``, until one of the sockets or descriptors it
watches is readable or another thread wakes it, never on a timer.

Its ``Wakeup`` is a pipe whose read end joins the poll set: another thread hands work over in
memory (a score came, a group was kept, a call is queued) and wakes the sleeper. One byte is written
per sleep, not per wake: a flag says one already waits in the pipe. The sleeper drains the pipe
before it lowers the flag and only then looks at what the wakers handed over; in the other order a
wake landing in between could leave the flag up over an empty pipe, and every later wake would be
skipped. ``Waiter.wait`` drains before it returns.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import zmq


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


class Waiter:
    """One thread's sleep over ``sources`` (ZeroMQ sockets, file descriptors) and, ``wakeable``, a
    wake-up (a pipe: a sleeper no other thread hands work to needs none)."""

    def __init__(self, *sources: Any, wakeable: bool = True) -> None:
        self._wakeup = Wakeup() if wakeable else None
        self._poller = zmq.Poller()
        self.watch(*sources, *([self._wakeup.fd] if wakeable else []))
        self.woken = False  # the last ``wait`` ended on a wake

    def watch(self, *sources: Any) -> None:
        for source in sources:
            self._poller.register(source, zmq.POLLIN)

    def unwatch(self, *sources: Any) -> None:
        for source in sources:
            self._poller.unregister(source)

    def wake(self) -> None:
        """End the sleeper's wait (or its next); safe from any thread, and after ``close``."""
        self._wakeup.wake()

    def wait(self, timeout_ms: int | None = None) -> set[Any]:
        """The watched sources that are readable, once one is, a wake comes or ``timeout_ms`` passes
        (None: no timeout; 0: a look)."""
        events = dict(self._poller.poll(timeout_ms))
        self.woken = self._wakeup is not None and self._wakeup.fd in events
        if self.woken:
            self._wakeup.drain()
            del events[self._wakeup.fd]
        return set(events)

    def close(self) -> None:
        if self._wakeup is not None:
            self._wakeup.close()
