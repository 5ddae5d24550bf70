"""The control plane between real processes: a peer that dies is reported at once, rank 0
reaches every engine in one round trip, and a race's news reaches rank 0 exactly once.

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
import time
from typing import Callable, Iterator

import pytest

from rollpacker.control.engine_server import EngineServer
from rollpacker.control.fleet import EngineClient, NewsInbox, ClusterFleet
from rollpacker.scheduler.calls import End, Retire, Stats
from rollpacker.control.transport import Endpoint, PeerLostError
from rollpacker.runtime.streaming import GroupInbox
from testkit import REPO_ROOT


class Fake:
    """What a server asks of any engine: it has no ready descriptor (it is polled), and is idle."""

    def ready_fd(self):
        return None

    def active_request_ids(self) -> list[str]:
        return []

    def stats(self):
        from rollpacker.rollout.engine import EngineStats
        return EngineStats()


class DiesOnStats(Fake):
    """An idle engine whose second ``stats`` kills the process serving it, halfway through a call."""

    asked = 0

    def stats(self):
        import os
        import signal

        DiesOnStats.asked += 1
        if DiesOnStats.asked > 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().stats()


class Slow(Fake):
    """An idle engine whose ``stats`` says on stdout that it has begun, then answers once its process
    reads a line on stdin (the test's go)."""

    def stats(self) -> str:
        import sys

        print("in stats", flush=True)
        sys.stdin.readline()
        return "slow but alive"


class Never(Fake):
    """An engine whose requests never finish."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.polls = 0

    def submit(self, requests) -> None:
        self.pending += [r.request_id for r in requests]

    def active_request_ids(self) -> list[str]:
        return list(self.pending)

    def poll(self, timeout=0.0):
        self.polls += 1
        return []

    def abort(self, request_ids) -> None:
        self.pending = [rid for rid in self.pending if rid not in set(request_ids)]


class Gate(Never):
    """An engine whose ``submit`` says on stdout that it arrived, then returns once its process reads
    a line on stdin (the test's go)."""

    def submit(self, requests) -> None:
        import sys

        print("submitted", [r.request_id for r in requests], flush=True)
        sys.stdin.readline()
        super().submit(requests)


class Refuses(Gate):
    """An engine that refuses every submit, saying so on stdout first."""

    def submit(self, requests) -> None:
        from rollpacker.rollout.engine import RequestError

        print("refused", [r.request_id for r in requests], flush=True)
        raise RequestError("no room", [r.request_id for r in requests])


class FinishesAtOnce(Never):
    """An engine whose every request finishes the first time its server steps it, with one token:
    how many of these engines its process made before it (a server makes one per round). Requests
    whose id starts with "slow" never finish; an evict hands them back with two tokens."""

    made = 0

    def __init__(self) -> None:
        super().__init__()
        self.number = FinishesAtOnce.made
        FinishesAtOnce.made += 1

    def poll(self, timeout=0.0):
        from rollpacker.rollout.engine import Completion

        done = [rid for rid in self.pending if not rid.startswith("slow")]
        self.pending = [rid for rid in self.pending if rid not in done]
        return [Completion(rid, [self.number], [-0.5], "stop") for rid in done]

    def evict(self, request_ids):
        from rollpacker.rollout.engine import Completion

        self.abort(request_ids)
        return [Completion(rid, [self.number] * 2, [-0.5] * 2, "evicted") for rid in request_ids]


class Rings(Never):
    """An engine with a ready descriptor, in the test's process: ``finish`` completes its requests
    and writes to the descriptor, as the SGLang host does; ``polls`` counts the server's looks."""

    def __init__(self) -> None:
        super().__init__()
        self.fd, self._ring = os.pipe()
        os.set_blocking(self.fd, False)
        self.finished: list[str] = []

    def ready_fd(self):
        return self.fd

    def poll(self, timeout=0.0):
        from rollpacker.rollout.engine import Completion

        self.polls += 1
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 64)
        done, self.finished = self.finished, []
        return [Completion(rid, [7], [-0.5], "stop") for rid in done]

    def finish(self) -> None:
        self.finished, self.pending = self.pending, []
        os.write(self._ring, b"\0")

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._ring)


class CountingInbox(NewsInbox):
    """A news inbox that counts the pushes it takes, stale ones included."""

    received = 0

    def _receive(self) -> list | None:
        message = super()._receive()
        self.received += message is not None
        return message


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
    """``script`` in a fresh interpreter; its first stdout line is read by the caller. This file's
    directory is on its path: the scripts import this module's engines."""
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO_ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{here}"})


@contextlib.contextmanager
def served(engine: str) -> Iterator[subprocess.Popen]:
    """A child process serving ``engine`` (a class of this module) as a rank's ``EngineServer``;
    its port is ``.port``."""
    server = child(f"""
        from rollpacker.control.engine_server import EngineServer
        from test_coordinator import {engine}
        server = EngineServer()
        print(server.port, flush=True)
        server.serve({engine}(), None)
    """)
    server.port = int(server.stdout.readline())
    try:
        yield server
    finally:
        server.kill()
        server.wait()


def remote(port: int, engine_id: int, timeout_s: float, news_inbox: NewsInbox | None = None) -> EngineClient:
    return EngineClient(Endpoint(1, f"tcp://127.0.0.1:{port}", ""), engine_id, news_inbox, timeout_s=timeout_s)


def group(key: int, prefix: str, n: int = 1, r0: int | None = None):
    """A group of ``n`` responses to a one-token prompt, complete once ``r0`` (all) are generated
    (unscored)."""
    from rollpacker.rollout.engine import SamplingParams
    from rollpacker.sample import Prompt
    from rollpacker.scheduler.group_race import GroupLaunch

    return GroupLaunch(key, Prompt(uid=key, input_ids=[1], data_source="t"), n, r0 or n, prefix, prefix,
                       SamplingParams(), scored=False)


def test_a_remote_call_raises_when_the_serving_rank_dies_in_it():
    with served("DiesOnStats") as server:
        proxy = remote(server.port, 1, timeout_s=60)
        proxy.call(Stats())  # answered: the connection is up
        error = raised_within(30, lambda: proxy.call(Stats()))
        proxy.shutdown()
        assert isinstance(error, PeerLostError) and "rank 1, serving engine 1, hung up" in str(error)
        assert server.wait() == -9


def test_a_serving_rank_raises_when_the_coordinator_dies():
    server = EngineServer()
    coordinator = child(f"""
        import os, signal
        from rollpacker.control.fleet import EngineClient
        from rollpacker.scheduler.calls import Stats
        from rollpacker.control.transport import Endpoint
        remote = EngineClient(Endpoint(1, "tcp://127.0.0.1:{server.port}", ""), 1, None)
        remote.call(Stats())
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    try:
        # answers the stats, then waits for the next call
        error = raised_within(30, lambda: server.serve(Never(), None))
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
        waiting = threading.Thread(target=lambda: answer.append(patient.call(Stats())), daemon=True)
        try:
            waiting.start()
            assert server.stdout.readline() == "in stats\n"  # the server is in the patient call
            with pytest.raises(TimeoutError, match="engine 2 on rank 1 did not answer Stats"):
                hasty.call(Stats())
            assert waiting.is_alive() and not answer
            server.stdin.write("go\n")
            server.stdin.flush()
            waiting.join(60)
            assert answer == ["slow but alive"]
        finally:
            patient.shutdown()
            hasty.shutdown()


def test_a_launch_reaches_every_engine_before_any_reply_and_a_refusal_leaves_every_channel_usable():
    """The driver sends each engine its groups before it waits on any reply (one round trip for N
    engines, not N): the second engine refuses while the first still holds its reply. The refusal is
    raised only after the first has answered, so no channel is left waiting on a reply, and the
    refused launch leaves no group racing on its engine."""
    from rollpacker.rollout.engine import RequestError
    from rollpacker.scheduler.clock import RealClock
    from rollpacker.scheduler.round_runner import EngineDriver

    news_inbox = NewsInbox()
    with served("Gate") as gate, served("Refuses") as refuses:
        proxies = [remote(gate.port, 1, timeout_s=60, news_inbox=news_inbox), remote(refuses.port, 2, timeout_s=60, news_inbox=news_inbox)]
        driver = EngineDriver(ClusterFleet(proxies, news_inbox, RealClock(), None))
        groups = [group(0, "a"), group(1, "b")]  # the least loaded engine takes the next group: one each
        outcome: list = []
        launch = threading.Thread(target=lambda: outcome.append(_raised(lambda: driver.launch(groups))))
        launch.start()
        assert gate.stdout.readline().split()[0] == "submitted"
        # while the first engine holds its reply (a driver that awaited it first would not get here)
        assert select.select([refuses.stdout], [], [], 30)[0], "the second engine got no launch"
        assert refuses.stdout.readline().split()[0] == "refused"
        assert launch.is_alive()
        gate.stdin.write("go\n")
        gate.stdin.flush()
        launch.join(60)
        error = outcome[0]
        print(f"launch over two engines: {error!r}; the first engine's reply was awaited first")
        assert isinstance(error, RequestError) and "no room" in str(error) and error.request_ids == ("b0",)
        assert [type(p.call(Stats())).__name__ for p in proxies] == ["EngineStats", "EngineStats"]
        assert [sorted(p.call(End()).spans) for p in proxies] == [[0], []]
        for p in proxies:
            p.shutdown()
    news_inbox.close()


def _raised(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - handed to the test
        return exc
    return None


def test_news_of_a_past_round_is_dropped_and_a_retire_hands_back_only_open_groups():
    """A server pushes its race's news to rank 0's news inbox as it comes, so a push can cross the round's
    end or a hand-off's retire. A push left from the last round is dropped in the next, where a
    deferred prompt's request ids (and here its group's key) come back: a stale group would pass
    for the one sampled under the new weights. A retire hands back the groups still open, with what
    their responses had generated, and never one whose completion was pushed already: that one
    reaches the driver once, from the news inbox."""
    from rollpacker.scheduler.clock import RealClock
    from rollpacker.scheduler.round_runner import EngineDriver

    server = child("""
        from rollpacker.control.engine_server import EngineServer
        from test_coordinator import FinishesAtOnce
        server = EngineServer()
        print(server.port, flush=True)
        while True:
            server.serve(FinishesAtOnce(), None)
    """)
    news_inbox = CountingInbox()
    proxy = remote(int(server.stdout.readline()), 0, timeout_s=60, news_inbox=news_inbox)

    def launch(driver: EngineDriver, key: int, prefix: str) -> None:  # finished at once: wait for its push
        driver.launch([group(key, prefix)])
        assert news_inbox.sock.poll(30_000), f"{prefix} was not pushed"

    def taken(driver: EngineDriver) -> list[tuple[int, list[int]]]:  # (group, its response's tokens)
        got: list = []
        while not got and driver.open_groups:
            got = [d for _, news in driver.poll() for d in news.done]
        return [(d.key, list(d.group.samples[0].response_ids)) for d in got]

    try:
        first = EngineDriver(ClusterFleet([proxy], news_inbox, RealClock(), None))
        launch(first, 0, "a")
        in_round = taken(first)
        launch(first, 1, "c")  # the round ends with c's push unread
        first.end()  # the server's loop ends with it; it serves the next round with a new engine
        second = EngineDriver(ClusterFleet([proxy], news_inbox, RealClock(), None))  # the next round: c launched again, under key 1 again
        launch(second, 1, "c")
        next_round = taken(second)
        launch(second, 2, "e")  # complete and pushed: not handed back
        second.launch([group(3, "slow", n=2, r0=1)])  # its two responses race on: handed back with their tokens
        handed, _ = proxy.call(Retire())  # what the driver's retire gets from the server
        after_retire = taken(second)
    finally:
        proxy.shutdown()
        news_inbox.close()
        server.kill()
        server.wait()
    print(f"taken in the round: {in_round}; in the next round: {next_round}; handed back by the retire: "
          f"{[(g.request_prefix, sorted(g.partial)) for g in handed]}, then taken: {after_retire}; pushes received: "
          f"{news_inbox.received}")
    assert in_round == [(0, [0])]  # from the server's first engine
    assert next_round == [(1, [1])], "the last round's group c was taken in the next"
    assert [(g.request_prefix, {r: list(c.output_ids) for r, c in g.partial.items()}) for g in handed] == \
        [("slow", {0: [1, 1], 1: [1, 1]})]
    assert after_retire == [(2, [1])]
    assert news_inbox.received == 4  # a, c, c again, e: each came, the stale one was dropped here


def test_a_server_sleeps_on_an_engine_that_rings_and_wakes_when_it_does():
    """An engine with a ready descriptor (the SGLang host writes to one per result) is not polled
    while it generates: its server sleeps until the engine rings, a message or a score comes. A
    polled engine's server would have looked at it every few milliseconds (every ``wait_s``)."""
    from rollpacker.scheduler.clock import RealClock
    from rollpacker.scheduler.round_runner import EngineDriver

    engine, server, news_inbox = Rings(), EngineServer(), NewsInbox()
    serving = threading.Thread(target=server.serve, args=(engine, None, 0.001), daemon=True)
    serving.start()
    proxy = remote(server.port, 0, timeout_s=60, news_inbox=news_inbox)
    try:
        driver = EngineDriver(ClusterFleet([proxy], news_inbox, RealClock(), None))
        driver.launch([group(0, "r", n=2)])
        time.sleep(0.5)
        polls_while_generating = engine.polls
        engine.finish()
        done: list = []
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            done = [d for _, news in driver.poll() for d in news.done]
        driver.end()  # and so the server's loop
        serving.join(30)
    finally:
        proxy.shutdown()
        news_inbox.close()
        server.close()
        engine.close()
    print(f"engine polls in 0.5 s of generating: {polls_while_generating} (0.001 s steps would make ~500); "
          f"after its ring: {[(d.key, [s.response_index for s in d.group.samples]) for d in done]}")
    assert polls_while_generating <= 2
    assert [(d.key, sorted(s.response_index for s in d.group.samples)) for d in done] == [(0, [0, 1])]
    assert not serving.is_alive()


def test_a_driver_on_a_news_inbox_sleeps_until_news_and_a_wake_ends_its_wait(monkeypatch):
    """With nothing new, the driver waits on its news inbox for the whole span until its next check that
    the servers are alive (made an hour here), not on a short timer: one wait per poll, which
    takes what came first without polling. A wake from another thread (the reward pool's, when a
    score comes) ends that wait at once, and a wake that came before the poll waited makes that
    wait return at once."""
    from rollpacker.control import fleet
    from rollpacker.scheduler.clock import RealClock
    from rollpacker.scheduler.round_runner import EngineDriver

    monkeypatch.setattr(fleet, "_LIVENESS_AFTER_S", 3600.0)
    with served("Never") as server:
        news_inbox = NewsInbox()
        proxy = remote(server.port, 1, timeout_s=60, news_inbox=news_inbox)
        try:
            driver = EngineDriver(ClusterFleet([proxy], news_inbox, RealClock(), None))
            driver.launch([group(0, "r")])
            waits: list[float] = []
            waiting = threading.Event()
            look = news_inbox.collect

            def collect(timeout_s: float = 0.0) -> list:
                waits.append(timeout_s)
                if timeout_s > 0:
                    waiting.set()
                return look(timeout_s)

            news_inbox.collect = collect
            polled: list = []
            poll = threading.Thread(target=lambda: polled.append(driver.poll()), daemon=True)
            poll.start()
            assert waiting.wait(60), "the driver never waited on its news inbox"
            driver.wake()  # as the reward pool's thread does when a score comes
            poll.join(60)
            assert not poll.is_alive(), "a wake did not end the driver's wait"
            first = list(waits)
            driver.wake()  # before the poll looks: it must return at once, not wait
            waits.clear()
            early = threading.Thread(target=lambda: polled.append(driver.poll()), daemon=True)
            started = time.monotonic()
            early.start()
            early.join(60)
            early_s = time.monotonic() - started
            assert not early.is_alive(), "a wake that came before the poll looked was lost"
        finally:
            proxy.shutdown()
            news_inbox.close()
    print(f"news inbox waits of the woken poll: {first}; of the poll woken before it waited: {waits}, "
          f"returned after {early_s:.3f} s")
    assert polled == [[], []]
    assert len(first) == 1 and first[0] > 3000, first
    assert len(waits) == 1 and early_s < 30, (waits, early_s)


def test_a_wake_after_the_news_inbox_closed_writes_to_no_file():
    """A late score of a past round may wake a news inbox that has closed; its pipe's descriptors may
    then name another file (here a new pipe, which takes the lowest free numbers): nothing reaches it."""
    news_inbox = NewsInbox()
    news_inbox.wake()
    assert news_inbox.collect(30) == [] and news_inbox.woken
    news_inbox.close()
    r, w = os.pipe()
    try:
        os.set_blocking(r, False)
        news_inbox.wake()
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
    finally:
        os.close(r)
        os.close(w)
    print("a wake after close: nothing written to the pipe that took its descriptors")


def test_a_wake_that_lands_while_the_news_inbox_drains_its_pipe_leaves_later_wakes_working(monkeypatch):
    """A score may wake the news inbox just as ``collect`` drains its pipe. That wake's news is seen by the
    caller at once; what matters is that the next wake still wakes: drained before the flag that
    spares repeated writes was lowered, a wake could leave that flag up with no byte in the pipe,
    and every later wake would then be skipped."""
    from rollpacker import wakeup

    news_inbox = NewsInbox()
    read = os.read

    def wake_then_read(fd: int, n: int) -> bytes:
        if fd == news_inbox._waiter._wakeup.fd:
            monkeypatch.setattr(wakeup.os, "read", read)
            news_inbox.wake()  # lands between the poll that saw the pipe and its drain
        return read(fd, n)

    try:
        news_inbox.wake()
        monkeypatch.setattr(wakeup.os, "read", wake_then_read)
        assert news_inbox.collect(30) == [] and news_inbox.woken
        news_inbox.wake()  # a later score
        assert news_inbox.collect(5) == [] and news_inbox.woken, "a wake after the drain was lost"
    finally:
        news_inbox.close()
    print("a wake during the drain, then another: both woke the news inbox")
