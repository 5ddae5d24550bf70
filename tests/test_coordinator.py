"""The coordinator channel between real processes: a peer that dies is reported at once.

Every test runs one end of the channel here and the other in a child process that it kills or
that kills itself, as a rank does when SIGKILL or the OOM killer reaches it. Before the channel
watched its connections, the survivor waited (a remote call up to its 600 s timeout, a serving
rank forever) until torchrun killed it after its 30 s shutdown timeout.
"""
from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import textwrap
import threading
from typing import Callable, Iterator

import pytest

from rollpacker.coordinator import ROUND_END, Bell, EngineServer, Endpoint, GroupInbox, PeerLostError, RemoteEngine
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.testing import REPO_ROOT


class DiesOnStats:
    """An idle engine whose ``stats`` kills the process serving it, halfway through a call."""

    def active_request_ids(self) -> list[str]:
        return []

    def release_memory(self, tags) -> None:
        pass

    def stats(self):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class Slow:
    """An idle engine whose ``stats`` says on stdout that it has begun, then answers once its process
    reads a line on stdin (the test's go)."""

    def active_request_ids(self) -> list[str]:
        return []

    def stats(self) -> str:
        import sys

        print("in stats", flush=True)
        sys.stdin.readline()
        return "slow but alive"


class Gate:
    """An engine whose ``submit`` says on stdout that it arrived, then returns once its process reads
    a line on stdin (the test's go)."""

    def active_request_ids(self) -> list[str]:
        return []

    def stats(self):
        from rollpacker.rollout.engine import EngineStats
        return EngineStats()

    def submit(self, requests) -> None:
        import sys

        print("submitted", [r.request_id for r in requests], flush=True)
        sys.stdin.readline()


class Refuses(Gate):
    """An engine that refuses every submit, saying so on stdout first."""

    def submit(self, requests) -> None:
        from rollpacker.rollout.engine import RequestError

        print("refused", [r.request_id for r in requests], flush=True)
        raise RequestError("no room")


class Never:
    """An engine whose requests never finish."""

    def __init__(self) -> None:
        self.pending: list[str] = []

    def submit(self, requests) -> None:
        self.pending += [r.request_id for r in requests]

    def active_request_ids(self) -> list[str]:
        return list(self.pending)

    def poll(self, timeout=0.0):
        return []

    def stats(self):
        from rollpacker.rollout.engine import EngineStats
        return EngineStats()


class FinishesAtOnce(Never):
    """An engine whose every request finishes the first time its server steps it, with one token:
    how many of these engines its process made before it (a server makes one per round)."""

    made = 0

    def __init__(self) -> None:
        super().__init__()
        self.number = FinishesAtOnce.made
        FinishesAtOnce.made += 1

    def poll(self, timeout=0.0):
        from rollpacker.rollout.engine import Completion

        done, self.pending = self.pending, []
        return [Completion(rid, [self.number], [-0.5], "stop") for rid in done]

    def abort(self, request_ids) -> None:
        self.pending = [rid for rid in self.pending if rid not in set(request_ids)]

    def evict(self, request_ids):
        self.abort(request_ids)
        return []


def raised_within(seconds: float, call: Callable[[], object]) -> BaseException:
    """What ``call`` raised, run in a thread; fails the test if it returned, or still waits after
    ``seconds`` (the hang this channel must not have)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert outcome, f"still waiting after {seconds} s"
    assert isinstance(outcome[0], BaseException), f"returned {outcome[0]!r}"
    return outcome[0]


def child(script: str) -> subprocess.Popen:
    """``script`` in a fresh interpreter; its first stdout line is read by the caller."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO_ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests'}"})


@contextlib.contextmanager
def served(engine: str) -> Iterator[subprocess.Popen]:
    """A child process serving ``engine`` (a class of this module) as a rank's ``EngineServer``;
    its port is ``.port``."""
    server = child(f"""
        from rollpacker.coordinator import EngineServer
        from test_coordinator import {engine}
        server = EngineServer()
        print(server.port, flush=True)
        server.serve({engine}())
    """)
    server.port = int(server.stdout.readline())
    try:
        yield server
    finally:
        server.kill()
        server.wait()


def remote(port: int, engine_id: int, timeout_s: float) -> RemoteEngine:
    return RemoteEngine(Endpoint(1, f"tcp://127.0.0.1:{port}", ""), engine_id=engine_id, timeout_s=timeout_s)


def test_a_remote_call_raises_when_the_serving_rank_dies_in_it():
    with served("DiesOnStats") as server:
        proxy = remote(server.port, 1, timeout_s=60)
        proxy.release_memory(["kv_cache"])  # answered: the connection is up
        error = raised_within(30, proxy.stats)
        proxy.shutdown()
        assert isinstance(error, PeerLostError) and "rank 1, serving engine 1, hung up" in str(error)
        assert server.wait() == -9


def test_a_serving_rank_raises_when_the_coordinator_dies():
    server = EngineServer()
    coordinator = child(f"""
        import os, signal
        from rollpacker.coordinator import Endpoint, RemoteEngine
        remote = RemoteEngine(Endpoint(1, "tcp://127.0.0.1:{server.port}", ""), engine_id=1)
        remote.release_memory(["kv_cache"])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    try:
        # answers release_memory, then waits for the next call
        error = raised_within(30, lambda: server.serve(DiesOnStats()))
        assert isinstance(error, PeerLostError) and "the coordinator (rank 0) hung up" in str(error)
    finally:
        server.close()
        coordinator.wait()
    assert coordinator.returncode == -9


def test_a_stream_training_rank_gets_what_was_sent_before_the_coordinator_died_then_an_error():
    inbox = GroupInbox()
    feeder = child(f"""
        import os, signal
        import zmq
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect("tcp://127.0.0.1:{inbox.port}")
        sock.send_pyobj("group 1")
        sock.send_pyobj("group 2")
        sock.close(linger=-1)
        zmq.Context.instance().term()  # returns once both are written to the connection, ahead of its end
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    try:
        feeder.wait()
        assert [inbox.receive(), inbox.receive()] == ["group 1", "group 2"]
        error = raised_within(30, inbox.receive)
        assert isinstance(error, PeerLostError) and "feeding this rank's stream trainer" in str(error)
    finally:
        inbox.close()


def test_a_slow_answer_is_not_a_hang_up():
    """Only a closed connection counts: a peer that takes its time is waited for, up to the timeout.
    The patient call waits through the hasty one's whole timeout: the server answers only after it."""
    with served("Slow") as server:
        patient, hasty = remote(server.port, 1, timeout_s=60), remote(server.port, 2, timeout_s=0.3)
        answer: list[str] = []
        waiting = threading.Thread(target=lambda: answer.append(patient.stats()), daemon=True)
        try:
            waiting.start()
            assert server.stdout.readline() == "in stats\n"  # the server is in the patient call
            with pytest.raises(TimeoutError, match="engine 2 on rank 1 did not answer stats"):
                hasty.stats()
            assert waiting.is_alive() and not answer
            server.stdin.write("go\n")
            server.stdin.flush()
            waiting.join(60)
            assert answer == ["slow but alive"]
        finally:
            patient.shutdown()
            hasty.shutdown()


def test_a_launch_reaches_every_engine_before_any_reply_and_a_refusal_leaves_every_channel_usable():
    """The driver sends each engine its submit before it waits on any reply (one round trip for N
    engines, not N): the second engine refuses while the first still holds its reply. The refusal is
    raised only after the first has answered, so no channel is left waiting on a reply."""
    from rollpacker.rollout.engine import GenerationRequest, RequestError, SamplingParams
    from rollpacker.scheduler.clock import RealClock
    from rollpacker.scheduler.dispatch import EngineDriver

    with served("Gate") as gate, served("Refuses") as refuses:
        proxies = [remote(gate.port, 1, timeout_s=60), remote(refuses.port, 2, timeout_s=60)]
        driver = EngineDriver(proxies, RealClock())
        requests = [GenerationRequest(f"r{i}", [1, 2], SamplingParams()) for i in range(2)]
        outcome: list = []
        launch = threading.Thread(target=lambda: outcome.append(_raised(lambda: driver.submit(requests))))
        launch.start()
        assert gate.stdout.readline().split()[0] == "submitted"
        # while the first engine holds its reply (a driver that awaited it first would not get here)
        assert select.select([refuses.stdout], [], [], 30)[0], "the second engine got no submit"
        assert refuses.stdout.readline().split()[0] == "refused"
        assert launch.is_alive()
        gate.stdin.write("go\n")
        gate.stdin.flush()
        launch.join(60)
        error = outcome[0]
        print(f"launch over two engines: {error!r}; the first engine's reply was awaited first")
        assert isinstance(error, RequestError) and "no room" in str(error)
        assert [type(p.stats()).__name__ for p in proxies] == ["EngineStats", "EngineStats"]
        for p in proxies:
            p.shutdown()


def _raised(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        return exc
    return None


def test_a_push_reaches_the_driver_only_while_its_request_is_outstanding():
    """A server pushes each completion to rank 0's bell as it finishes, so a push can cross rank 0's
    abort, a hand-off's evict or the round's end. The driver takes only what it still waits for: a
    response finished before its abort came is dropped; one finished before an evict
    comes back once, in the evict's hand-back; and a push left from the last round is dropped in the
    next, where a deferred prompt's request ids come back (a stale response would pass for the one
    sampled under the new weights)."""
    from rollpacker.scheduler.clock import RealClock
    from rollpacker.scheduler.dispatch import EngineDriver

    server = child("""
        from rollpacker.coordinator import EngineServer
        from test_coordinator import FinishesAtOnce
        server = EngineServer()
        print(server.port, flush=True)
        while True:
            server.serve(FinishesAtOnce())
    """)
    bell = Bell()
    proxy = RemoteEngine(Endpoint(1, f"tcp://127.0.0.1:{int(server.stdout.readline())}", ""), engine_id=1,
                         timeout_s=60, bell=bell)

    def launch(driver: EngineDriver, rid: str) -> None:  # it finishes at once; wait until its push is here
        driver.submit([GenerationRequest(rid, [1], SamplingParams())])
        assert bell.sock.poll(30_000), f"{rid} was not pushed"

    def taken(driver: EngineDriver) -> list[tuple[str, list[int]]]:
        got: list = []
        while not got and driver.outstanding:
            got = driver.poll()
        return [(c.request_id, list(c.output_ids)) for c in got]

    try:
        first = EngineDriver([proxy], RealClock())
        launch(first, "a")
        first.abort(["a"])
        launch(first, "b")
        after_abort = taken(first)
        launch(first, "c")
        first.abort(first.outstanding_ids())  # the round closes with c's push unread
        proxy.stop_serving(ROUND_END)
        second = EngineDriver([proxy], RealClock())  # the next round: c launched again
        launch(second, "c")
        next_round = taken(second)
        launch(second, "e")
        handed = [(c.request_id, c.finish_reason) for c in second.retire([0])]
        after_retire = second.poll()
    finally:
        proxy.shutdown()
        bell.close()
        server.kill()
        server.wait()
    print(f"taken after the abort: {after_abort}; in the next round: {next_round}; handed back by the "
          f"evict: {handed}, then taken: {after_retire}; pushes received: {bell.received}")
    assert after_abort == [("b", [0])], "the aborted response, or the wrong one, was taken"
    assert next_round == [("c", [1])], "the last round's response to c was taken in the next"
    assert handed == [("e", "stop")] and after_retire == []
    assert bell.received == 5  # a, b, c, c again, e: each came, the stale ones were dropped here


def test_a_driver_on_a_bell_sleeps_until_news_and_a_wake_ends_its_wait(monkeypatch):
    """With nothing finished, the driver waits on its bell for the whole span until its next full
    sweep (made an hour here), not on a short timer: one look and one wait per poll. A wake from
    another thread (the reward pool's, when a score comes) ends that wait at once, and a wake that
    came before the poll looked makes the poll return without waiting at all."""
    from rollpacker.scheduler import dispatch
    from rollpacker.scheduler.clock import RealClock

    monkeypatch.setattr(dispatch, "_FULL_SWEEP_AFTER_S", 3600.0)
    with served("Never") as server:
        bell = Bell()
        proxy = RemoteEngine(Endpoint(1, f"tcp://127.0.0.1:{server.port}", ""), engine_id=1, timeout_s=60, bell=bell)
        try:
            driver = dispatch.EngineDriver([proxy], RealClock())
            driver.submit([GenerationRequest("r", [1], SamplingParams())])
            waits: list[float] = []
            waiting = threading.Event()
            look = bell.collect

            def collect(timeout_s: float = 0.0) -> list:
                waits.append(timeout_s)
                if timeout_s > 0:
                    waiting.set()
                return look(timeout_s)

            bell.collect = collect
            polled: list = []
            poll = threading.Thread(target=lambda: polled.append(driver.poll()), daemon=True)
            poll.start()
            assert waiting.wait(60), "the driver never waited on its bell"
            driver.wake()  # as the reward pool's thread does when a score comes
            poll.join(60)
            assert not poll.is_alive(), "a wake did not end the driver's wait"
            first = list(waits)
            driver.wake()  # before the poll looks: it must return at once, not wait
            waits.clear()
            early = threading.Thread(target=lambda: polled.append(driver.poll()), daemon=True)
            early.start()
            early.join(60)
            assert not early.is_alive(), "a wake that came before the poll looked was lost"
        finally:
            proxy.shutdown()
            bell.close()
    print(f"bell waits of the woken poll: {first}; of the poll woken before it looked: {waits}")
    assert polled == [[], []]
    assert first[0] == 0 and len(first) == 2 and first[1] > 3000, first
    assert waits == [0.0], waits


def test_a_wake_after_the_bell_closed_writes_to_no_file():
    """A late score of a past round may wake a bell that has closed; its pipe's descriptors may
    then name another file (here a new pipe, which takes the lowest free numbers): nothing reaches it."""
    bell = Bell()
    bell.wake()
    assert bell.collect(30) == [] and bell.woken
    bell.close()
    r, w = os.pipe()
    try:
        os.set_blocking(r, False)
        bell.wake()
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
    finally:
        os.close(r)
        os.close(w)
    print("a wake after close: nothing written to the pipe that took its descriptors")


def test_a_wake_that_lands_while_the_bell_drains_its_pipe_leaves_later_wakes_working(monkeypatch):
    """A score may wake the bell just as ``collect`` drains its pipe. That wake's news is seen by the
    caller at once; what matters is that the next wake still wakes: drained before the flag that
    spares repeated writes was lowered, a wake could leave that flag up with no byte in the pipe,
    and every later wake would then be skipped."""
    from rollpacker import wakeup

    bell = Bell()
    read = os.read

    def wake_then_read(fd: int, n: int) -> bytes:
        if fd == bell._wakeup.fd:
            monkeypatch.setattr(wakeup.os, "read", read)
            bell.wake()  # lands between the poll that saw the pipe and its drain
        return read(fd, n)

    try:
        bell.wake()
        monkeypatch.setattr(wakeup.os, "read", wake_then_read)
        assert bell.collect(30) == [] and bell.woken
        bell.wake()  # a later score
        assert bell.collect(5) == [] and bell.woken, "a wake after the drain was lost"
    finally:
        bell.close()
    print("a wake during the drain, then another: both woke the bell")
