"""Rank 0 at cluster scale: the coordinator's own CPU cost while it drives N engines.

    python -m bench.system.control --engines 8,32,128,512 [--rounds 2] [--speed 1] [--out FILE]

Rank 0 here is this process, running what rank 0 runs in training: the real ``Scheduler``
(tail batching) over the real control plane (an ``EngineClient`` per engine, ZeroMQ REQ/REP
to an ``EngineServer``, whose race of the groups placed on its engine pushes its news to rank 0's
news inbox), its own engine raced in-process (asleep on the news inbox and the engine's ready descriptor, as
with an SGLang engine), and node 0's reward pool: rank 0 is node 0's first rank, so the pool that
scores node 0's engines (``--engines-per-node``) runs here, serving node 0's other engines through
a ``RewardService``; its worker processes decode
the responses with a byte-level BPE tokenizer and score them. The other engine endpoints are
``EngineServer``s, a few host processes each serving many of them through one ZeroMQ poller, the
engines of other nodes scored by a pool of the host process's own (their node's). Behind each
server is a modeled engine (``rollpacker.sim.SimEngine``, Qwen2.5-7B on one H800) replayed on the
model's clock (``--speed`` > 1 compresses it, for quick looks only: rank 0's work does not
compress, so the races between generation and scoring, and with them the work per round, are not
the real ones), returning responses of the modeled length with token ids and logprobs, as a real
engine does. They stand in for engine speed only; the subject is rank 0.

Workload: 32 requests per engine per round (16,384 at 512 engines): P0 = 2 x engines prompts,
R0 = 8, every prompt launched with 16 responses (eta_p 1, eta_r 2), so each group completes on
its first 8 scored responses and its other 8 are aborted. Response lengths: the long-tail model
of ``bench/system/sim.py`` at an 8k limit.

Measured per round: rank 0's CPU seconds (``time.process_time`` of this process: scheduler,
channel, its own engine's race, node 0's reward dispatch and ZeroMQ's I/O thread; the
endpoint hosts and reward workers are other processes) and their split by thread, the messages
it exchanged, the latency from the round's launch to each request reaching its engine, and the
round's modeled time (the same rounds on a virtual clock, rank 0 costing nothing). Rank 0's cost
has a part per event and a part per wall second it waits (an idle coordinator may still wake up);
a compressed replay shortens the
waiting, so that part is measured separately (``idle_cpu_per_s``: rank 0 waiting on one group
that runs on its own engine for ``--idle-s``) and the cost at real speed is projected as measured +
idle_cpu_per_s x (modeled - replayed wall), which adds nothing at ``--speed 1``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import psutil
import zmq

from bench.tools.results import REPO, write_results
from rollpacker.control.engine_server import EngineServer
from rollpacker.control.fleet import EngineClient, NewsInbox, ClusterFleet
from rollpacker.control.transport import Endpoint
from rollpacker.examples.task import TASK_NAME
from rollpacker.examples.tokenizer import build_tokenizer
from rollpacker.reward import RewardConfig, RewardPool
from rollpacker.reward.service import RemoteRewardSink, RewardService
from rollpacker.reward.sink import PoolRewardSink
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import Completion, GenerationRequest, RolloutEngine, SamplingParams
from rollpacker.sample import Prompt
from rollpacker.scheduler import ListPromptSource, LocalFleet, Scheduler, VirtualClock
from rollpacker.scheduler.config import PlannerConfig, SchedulerConfig
from rollpacker.scheduler.round_runner import EngineDriver
from rollpacker.scheduler.group_race import GroupLaunch
from rollpacker.sim.engine import SimEngine
from rollpacker.sim.perf import H800, QWEN25, PerfModel
from rollpacker.sim.reward import SimRewardSink
from rollpacker.sim.traces import LengthOracle, longtail_trace
from rollpacker.wakeup import Wakeup

IDLE = "idle-probe"  # the idle probe's request-id prefix: the longest response, so it outlasts the probe
MODEL, LIMIT, R0, RESPONSES = "7b", 8192, 8, 16
# response token ids: bytes of the tokenizer's vocabulary (ids 2..257), so decoding yields text
TOKENS = [2 + (i * 7919) % 256 for i in range(LIMIT)]
LOGPROBS = [-0.01 * (1 + i % 97) for i in range(LIMIT)]


class ScaledClock:
    """The model's time, ``speed`` times faster than the wall clock."""

    def __init__(self, speed: float) -> None:
        self.speed, self.origin = speed, time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self.origin) * self.speed

    def wall(self, t: float) -> float:
        return self.origin + t / self.speed


def trace_for(engines: int, rounds: int, seed: int):
    prompts = 2 * engines * rounds  # every prompt once: each response has its traced length
    return longtail_trace(prompts, samples=RESPONSES, median=LIMIT / 28, limit=LIMIT, seed=seed)


def scheduler_for(engines: int, trace) -> Scheduler:
    # the wall-clock race: its replayed engines report no per-request progress (the deterministic race's
    # control-plane cost at scale is not measured here)
    cfg = SchedulerConfig(mode="tail_batching", p0=2 * engines, r0=R0, eta_p=1.0, eta_r=RESPONSES / R0,
                          planner=PlannerConfig(enabled=False), race="first_finished")
    prompts = [Prompt(uid=i, input_ids=[TOKENS[j % 64] for j in range(p.prompt_length)], data_source=TASK_NAME,
                      ground_truth="7") for i, p in enumerate(trace)]
    return Scheduler(cfg, RolloutConfig(tp=1, max_response_length=LIMIT), ListPromptSource(prompts),
                     rollout_ranks=engines)


class Replay:
    """What every process that serves modeled engines needs: the model's clock and lengths."""

    def __init__(self, engines: int, rounds: int, speed: float, seed: int) -> None:
        self.clock = ScaledClock(speed)
        self.perf = PerfModel(QWEN25[MODEL], H800, 1)
        self.oracle = LengthOracle(trace_for(engines, rounds, seed), seed=seed)
        self.arrivals: dict[str, list[float]] = {}

    def engine(self, engine_id: int, ring: bool = False) -> "ReplayEngine":
        length = lambda r: LIMIT if r.request_id.startswith(IDLE) else self.oracle(r)  # noqa: E731
        return ReplayEngine(SimEngine(self.perf, self.clock, length, engine_id=engine_id), self.arrivals, ring)


# ---- endpoint hosts ---------------------------------------------------------------------------

class ReplayEngine(RolloutEngine):
    """A modeled engine as an endpoint serves it: notes when each request arrived (wall clock) and
    answers with token ids and logprobs of the modeled length. ``ring``: it has a ``ready_fd`` as an
    SGLang engine has (a thread writes to it when the model's next event is due), so that a server
    sleeps on it, as rank 0's own engine's server does in training."""

    def __init__(self, sim: SimEngine, arrivals: dict[str, list[float]], ring: bool = False) -> None:
        self.sim, self.arrivals = sim, arrivals
        self.engine_id = sim.engine_id
        self._lock = threading.Lock()  # the ringing thread reads the model while the server's changes it
        self._fd: int | None = None
        if ring:
            self._fd, self._ring = os.pipe()
            os.set_blocking(self._fd, False)
            self._changed, self._closed = threading.Event(), False
            threading.Thread(target=self._ring_when_due, name="replay-ring", daemon=True).start()

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        now = time.monotonic()
        for r in requests:
            self.arrivals.setdefault(r.request_id, []).append(now)
        self._changing(self.sim.submit, requests)

    def poll(self, timeout: float | None = 0.0) -> list[Completion]:
        if self._fd is not None:
            with contextlib.suppress(BlockingIOError):
                os.read(self._fd, 1 << 16)
        done = self._changing(self.sim.poll, 0.0)
        return [replace(c, output_ids=TOKENS[:len(c.output_ids)], logprobs=LOGPROBS[:len(c.logprobs)]) for c in done]

    def ready_fd(self) -> int | None:
        return self._fd

    def abort(self, request_ids: Iterable[str]) -> None:
        self._changing(self.sim.abort, request_ids)

    def evict(self, request_ids: Iterable[str]) -> list[Completion]:
        return self._changing(self.sim.evict, request_ids)

    def active_request_ids(self) -> list[str]:
        with self._lock:
            return self.sim.active_request_ids()

    def update_weights(self, named_tensors) -> None:
        self.sim.update_weights(named_tensors)

    def release_memory(self, tags=()) -> None:
        self.sim.release_memory(tags)

    def resume_memory(self, tags=()) -> None:
        self.sim.resume_memory(tags)

    def stats(self):
        with self._lock:
            return self.sim.stats()

    def next_wall_time(self) -> float | None:
        with self._lock:
            t = self.sim.next_event_time()
        return None if t is None else self.sim.clock.wall(t)

    def close(self) -> None:
        if self._fd is not None:
            self._closed = True
            self._changed.set()

    def _changing(self, method, *args):
        with self._lock:
            out = method(*args)
        if self._fd is not None:
            self._changed.set()
        return out

    def _ring_when_due(self) -> None:
        while not self._closed:
            due = self.next_wall_time()
            wait = None if due is None else due - time.monotonic()
            if wait is not None and wait <= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._ring, b"\0")
                wait = None  # until the poll it rang for (or another change) moves the model on
            self._changed.wait(wait)
            self._changed.clear()
        os.close(self._ring)
        os.close(self._fd)


class MultiplexedServer(EngineServer):
    """One of the many engine servers an endpoint host runs on one poller (the program's each run
    their own ``serve`` loop): a score marks this server and wakes the host, which then steps it."""

    def __init__(self, shared: Wakeup, index: int, marked: set[int]) -> None:
        super().__init__()
        self._shared, self._index, self._marked = shared, index, marked

    def bind(self, engine: RolloutEngine, reward: Any) -> None:
        self._engine, self._reward = engine, reward

    @property
    def socket(self) -> zmq.Socket:
        return self._channel.sock

    def answer(self) -> bool:
        """Answer the call waiting on ``socket``; whether it ended the server's round."""
        return self._answer() is not None

    def advance(self) -> None:
        self._advance()

    def _wake(self) -> None:
        self._marked.add(self._index)
        self._shared.wake()


class CountingInbox(NewsInbox):
    """Rank 0's news inbox, counting the pushes it takes."""

    received = 0

    def _receive(self) -> list[zmq.Frame] | None:
        message = super()._receive()
        self.received += message is not None
        return message


def serve(count: int, first_id: int, args: argparse.Namespace) -> None:
    """An endpoint host: ``count`` EngineServers multiplexed on one poller until each has served its
    last round (the idle probe's and the trace's: each ends with its race's end).
    Node 0's engines score on rank 0's pool (``--node0-reward``), the others on this host's own."""
    replay = Replay(int(args.engines), args.rounds, args.speed, args.seed)
    ids = range(first_id, first_id + count)
    in_node0 = [i < args.engines_per_node for i in ids]
    pool = (RewardPool(RewardConfig(num_workers=args.reward_workers), tokenizer=build_tokenizer())
            if not all(in_node0) else None)
    node0 = RemoteRewardSink(args.node0_reward) if any(in_node0) else None
    sinks = [node0 if mine else PoolRewardSink(pool) for mine in in_node0]
    shared, marked = Wakeup(), set()
    servers = [MultiplexedServer(shared, i, marked) for i in range(count)]
    hosted = [replay.engine(i) for i in ids]
    for server, engine, sink in zip(servers, hosted, sinks):
        server.bind(engine, sink)
    if pool is not None:
        pool.wait_ready()
    print(json.dumps({"ports": [s.port for s in servers]}), flush=True)
    poller = zmq.Poller()
    poller.register(shared.fd, zmq.POLLIN)
    index = {}
    for i, s in enumerate(servers):
        poller.register(s.socket, zmq.POLLIN)
        index[s.socket] = i
    answered = [0] * count
    rounds_left = [1 + args.rounds] * count  # the idle probe's round, then every round of the trace (a host's --rounds)
    live = count
    parent = os.getppid()
    # a host's parent is rank 0: killed (a test's timeout), it must not leave this process spinning
    while live and os.getppid() == parent:
        wake = [t for t in (e.next_wall_time() for e in hosted) if t is not None]
        timeout = 1000 if not wake else min(1000, max(0, int((min(wake) - time.monotonic()) * 1000) + 1))
        events = dict(poller.poll(timeout))
        if shared.fd in events:
            shared.drain()
        due = set(marked)
        marked.clear()
        for i, engine in enumerate(hosted):  # completions due by now are raced and told to rank 0
            if engine.next_wall_time() is not None and engine.next_wall_time() <= time.monotonic():
                due.add(i)
        for i in due:
            servers[i].advance()
        for sock in events:
            if sock == shared.fd:
                continue
            i = index[sock]
            servers[i].advance()
            ended = servers[i].answer()
            answered[i] += 1
            if ended:
                rounds_left[i] -= 1
            if ended and not rounds_left[i]:
                poller.unregister(sock)
                live -= 1
            elif ended:  # the next round gets a fresh engine
                hosted[i] = replay.engine(first_id + i)
                servers[i].bind(hosted[i], sinks[i])
    for s in servers:
        s.close()
    if node0 is not None:
        node0.close()
    if pool is not None:
        pool.close()
    print(json.dumps({"answered": answered, "arrivals": replay.arrivals}), flush=True)


class Hosts:
    """The endpoint host processes (engines 1..N-1), each in its own process group, killed with it
    on every exit path."""

    def __init__(self, args: argparse.Namespace, engines: int, rounds: int, node0_reward: str) -> None:
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[Endpoint] = []
        try:
            hosts = min(args.hosts, engines - 1)
            per = -(-(engines - 1) // hosts)
            for first in range(1, engines, per):
                count = min(per, engines - first)
                cmd = [sys.executable, "-m", "bench.system.control", "--serve", str(count), "--first-id", str(first),
                       "--engines", str(engines), "--rounds", str(rounds), "--speed", str(args.speed),
                       "--seed", str(args.seed), "--reward-workers", str(args.reward_workers),
                       "--engines-per-node", str(args.engines_per_node), "--node0-reward", node0_reward]
                self.procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True,
                                                   start_new_session=True))
            for proc in self.procs:
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"endpoint host {proc.args} exited with {proc.wait()} before serving")
                for port in json.loads(line)["ports"]:
                    self.endpoints.append(Endpoint(len(self.endpoints) + 1, f"tcp://127.0.0.1:{port}", ""))
        except BaseException:
            self.kill()
            raise

    def reports(self) -> list[dict[str, Any]]:
        out = []
        for proc in self.procs:
            line = proc.stdout.readline()
            if proc.wait(60) != 0 or not line:
                raise RuntimeError(f"endpoint host {proc.args} failed (exit {proc.returncode})")
            out.append(json.loads(line))
        return out

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- rank 0 -----------------------------------------------------------------------------------

class CountingRace(EngineClient):
    """The coordinator's handle on a race, counting the calls it sends (each gets one reply)."""

    def __init__(self, endpoint: Endpoint, engine_id: int, news_inbox: NewsInbox, clock: ScaledClock) -> None:
        super().__init__(endpoint, engine_id, news_inbox, clock=clock)
        self.sent: collections.Counter[str] = collections.Counter()

    def begin(self, call: Any) -> Any:
        self.sent[type(call).__name__.lower()] += 1
        return super().begin(call)


def idle_cpu_per_s(engines: list, sink: PoolRewardSink, seconds: float) -> float:
    """Rank 0's CPU per wall second while it waits on one group that runs on its own engine (the part
    of its cost a compressed replay does not show)."""
    driver = EngineDriver(ClusterFleet(engines, engines[-1].news_inbox, ScaledClock(1.0), sink))
    prompt = Prompt(uid=-1, input_ids=[TOKENS[0]] * 16, data_source=TASK_NAME, ground_truth="7")
    driver.launch([GroupLaunch(0, prompt, 1, 1, IDLE, IDLE, SamplingParams(max_new_tokens=LIMIT))])
    cpu, wall = time.process_time(), time.monotonic()
    while time.monotonic() - wall < seconds:
        assert not driver.poll(), "the idle probe's request finished early"
    rate = (time.process_time() - cpu) / (time.monotonic() - wall)
    driver.end()
    return rate


def modeled_rounds(engines: int, rounds: int, seed: int) -> list[float]:
    """The rounds' time on the model alone: the same scheduler and engines on a virtual clock."""
    trace = trace_for(engines, rounds, seed)
    scheduler, clock = scheduler_for(engines, trace), VirtualClock()
    oracle, perf, sink = LengthOracle(trace, seed=seed), PerfModel(QWEN25[MODEL], H800, 1), SimRewardSink(clock)
    out = []
    for _ in range(rounds):
        plan = scheduler.plan_round()
        sims = [SimEngine(perf, clock, oracle, engine_id=i) for i in range(engines)]
        out.append(scheduler.run_round(plan, LocalFleet(sims, clock, sink)).stats.rollout_seconds)
    return out


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of each of this process's threads so far, by thread id, with the name Python gave
    it (threads Python did not start, as ZeroMQ's I/O thread, are "other")."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    return {t.id: (names.get(t.id) or _os_name(t.id), t.user_time + t.system_time) for t in psutil.Process().threads()}


def _os_name(tid: int) -> str:
    """A thread Python did not start, by the name its library gave it (ZeroMQ's: "ZMQbg/IO/0")."""
    try:
        return "zmq-io" if Path(f"/proc/self/task/{tid}/comm").read_text().startswith("ZMQbg/IO") else "other"
    except OSError:
        return "other"


def thread_split(before: dict[int, tuple[str, float]], cpu_s: float) -> dict[str, float]:
    """The process's ``cpu_s`` since ``before``, by thread name; what threads that ended meanwhile
    (a replayed engine's) used is in "other" with the unnamed threads'."""
    out: dict[str, float] = collections.defaultdict(float)
    for tid, (name, seconds) in thread_cpu().items():
        if name != "other":
            out[name] += seconds - before.get(tid, (name, 0.0))[1]
    out["other"] = cpu_s - sum(out.values())
    return dict(out)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {f"p{q}": ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] for q in (50, 90, 99)} | {
        "max": ordered[-1]}


def run_size(engines: int, args: argparse.Namespace) -> dict[str, Any]:
    total = args.warmup + args.rounds  # the endpoint hosts take their lengths from a trace of as many rounds
    modeled = modeled_rounds(engines, total, args.seed)
    scheduler = scheduler_for(engines, trace_for(engines, total, args.seed))
    replay = Replay(engines, total, args.speed, args.seed)  # rank 0's own engine
    news_inbox, races, hosts = CountingInbox(), [], None
    # node 0's reward pool, in rank 0's process: its own engine scores there, node 0's others through the service
    with RewardPool(RewardConfig(num_workers=args.reward_workers), tokenizer=build_tokenizer()) as pool:
        service, sink = RewardService(pool), PoolRewardSink(pool)
        try:
            hosts = Hosts(args, engines, total, f"tcp://127.0.0.1:{service.port}")
            pool.wait_ready()
            clock = ScaledClock(args.speed)
            races = [CountingRace(ep, i, news_inbox, clock) for i, ep in enumerate(hosts.endpoints, start=1)]
            probe = replay.engine(0, ring=True)
            idle = idle_cpu_per_s([probe, *races], sink, args.idle_s)
            probe.close()
            rounds, launches = [], []
            profiler = cProfile.Profile(time.thread_time) if args.profile else None  # main thread CPU
            for index in range(total):
                if index == args.warmup:  # what the warm-up rounds sent is not counted
                    sent_before = sum((r.sent for r in races), collections.Counter())
                    pushes_before = news_inbox.received
                plan = scheduler.plan_round()
                cpu, main_cpu, wall = time.process_time(), time.thread_time(), time.monotonic()
                threads = thread_cpu()
                launches.append(wall)
                if profiler and index >= args.warmup:
                    profiler.enable()
                own = replay.engine(0, ring=True)  # rank 0's own engine, raced in this process, a fresh one a round
                result = scheduler.run_round(plan, ClusterFleet([own, *races], news_inbox, clock, sink))  # its end stops the servers
                own.close()
                if profiler:
                    profiler.disable()
                cpu, main_cpu, wall = time.process_time() - cpu, time.thread_time() - main_cpu, time.monotonic() - wall
                threads = thread_split(threads, cpu)
                s = result.stats
                print(f"[{engines} engines] round {index}{' (warm-up)' if index < args.warmup else ''}: "
                      f"{s.launched_responses} requests, rank 0 CPU {cpu:.2f} s in {wall:.2f} s wall; modeled "
                      f"{modeled[index]:.1f} s, replayed {s.rollout_seconds:.1f} s", flush=True)
                if index < args.warmup:
                    continue
                rounds.append({"index": index, "kind": result.kind.value, "requests": s.launched_responses,
                               "kept_groups": s.kept_prompts, "samples": result.num_samples, "cpu_s": cpu,
                               "main_thread_cpu_s": main_cpu, "thread_cpu_s": threads,
                               "wall_s": wall, "replayed_s": s.rollout_seconds, "modeled_s": modeled[index],
                               "generated_tokens": s.generated_tokens})
            sent = sum((r.sent for r in races), collections.Counter()) - sent_before
            sent["push"] = news_inbox.received - pushes_before  # the races' news (one-way, no reply)
            reports = hosts.reports()
        finally:
            for race in races:
                race.shutdown()
            news_inbox.close()
            service.close()
            if hosts is not None:
                hosts.kill()
    p0 = 2 * engines
    arrivals = {rid: t for r in [*reports, {"arrivals": replay.arrivals}] for rid, t in r["arrivals"].items()
                if not rid.startswith(IDLE) and _round_of(rid, p0) >= args.warmup}
    out = summarize(rounds, launches, sent, arrivals, idle, p0)
    out |= {"engines": engines, "messages_sent_all": sum(sum(r.sent.values()) for r in races),
            "messages_answered_all": sum(sum(r["answered"]) for r in reports)}
    if profiler:
        out["profile"] = hot_spots(profiler)
    return out


def _round_of(request_id: str, p0: int) -> int:
    """Prompts are served in order, ``p0`` a round (every group completes: nothing is deferred)."""
    return int(request_id[1:request_id.index("e")]) // p0


def hot_spots(profiler: cProfile.Profile, top: int = 15) -> list[dict[str, Any]]:
    """The functions where rank 0 spent its own time (cProfile's tottime), most first."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls": calls, "own_s": own, "cumulative_s": cum}
            for (f, line, name), (_, calls, own, cum, _) in rows]


def summarize(rounds: list[dict], launches: list[float], sent: collections.Counter,
              arrivals: dict[str, list[float]], idle: float, p0: int) -> dict[str, Any]:
    """Per-round costs projected to real speed, their means, and what the test checks."""
    latencies = [times[0] - launches[_round_of(rid, p0)] for rid, times in arrivals.items()]
    for r in rounds:
        r["projected_cpu_s"] = r["cpu_s"] + idle * max(0.0, r["modeled_s"] - r["wall_s"])
        r["overhead"] = r["projected_cpu_s"] / r["modeled_s"]
    requests = sum(r["requests"] for r in rounds)
    total = {k: sum(r[k] for r in rounds) for k in ("cpu_s", "projected_cpu_s", "wall_s", "modeled_s")}
    messages = sum(sent.values())
    return {
        "rounds": rounds, "requests_per_round": requests / len(rounds), "requests": requests,
        "dispatched": len(arrivals), "dispatched_twice": sum(len(t) > 1 for t in arrivals.values()),
        "messages": dict(sent), "idle_cpu_per_s": idle,
        "cpu_s_per_round": total["cpu_s"] / len(rounds),
        "main_thread_cpu_s_per_round": sum(r["main_thread_cpu_s"] for r in rounds) / len(rounds),
        "thread_cpu_s_per_round": {name: sum(r["thread_cpu_s"].get(name, 0.0) for r in rounds) / len(rounds)
                                   for name in sorted({n for r in rounds for n in r["thread_cpu_s"]})},
        "projected_cpu_s_per_round": total["projected_cpu_s"] / len(rounds),
        "cpu_us_per_request": 1e6 * total["projected_cpu_s"] / requests,
        "modeled_s_per_round": total["modeled_s"] / len(rounds), "wall_s_per_round": total["wall_s"] / len(rounds),
        "replayed_s_per_round": sum(r["replayed_s"] for r in rounds) / len(rounds),  # model time, rank 0 included
        "overhead": total["projected_cpu_s"] / total["modeled_s"],
        "messages_per_round": messages / len(rounds), "messages_per_modeled_s": messages / total["modeled_s"],
        "messages_per_wall_s": messages / total["wall_s"],
        "launch_to_engine_ms": {k: 1e3 * v for k, v in percentiles(latencies).items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="8,32,128,512", help="engine counts, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="rounds measured per engine count")
    p.add_argument("--warmup", type=int, default=1,
                   help="rounds run first and not measured (a fresh rank 0 pays its first round's page faults)")
    p.add_argument("--speed", type=float, default=1.0, help="replay the model this many times faster than real")
    p.add_argument("--hosts", type=int, default=2, help="endpoint host processes")
    p.add_argument("--reward-workers", type=int, default=1, help="reward workers of each pool (node 0's, each host's)")
    p.add_argument("--engines-per-node", type=int, default=8, help="engines scored by node 0's pool, on rank 0")
    p.add_argument("--idle-s", type=float, default=1.0, help="wall seconds of the idle-cost probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--before", help="an earlier results file to keep as the 'before' of a fix")
    p.add_argument("--before-note", default="", help="what the 'before' run's code did that the fix changed")
    p.add_argument("--profile", action="store_true", help="cProfile rank 0 over the rounds (inflates its CPU)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "control.json"), help="raw results (JSON)")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--first-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--node0-reward", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.first_id, args)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # two sockets and a connection per engine
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the endpoint hosts die with this process
    settings = {k: v for k, v in vars(args).items()
                if k not in ("out", "before", "before_note", "serve", "first_id", "node0_reward")}
    settings |= {"model": f"Qwen2.5-{MODEL.upper()}, TP 1, H800 (modeled)", "limit": LIMIT, "r0": R0,
                 "responses_per_prompt": RESPONSES, "p0_per_engine": 2}
    payload: dict[str, Any] = {"settings": settings, "sizes": []}
    if args.before:  # the run before a fix, with its own command, commit and date
        before = json.loads(Path(args.before).read_text())
        payload["before"] = {k: v for k, v in before.items() if k != "before"} | {"note": args.before_note}
    for n in args.engines.split(","):
        payload["sizes"].append(run_size(int(n), args))
        path = write_results(args.out, payload)  # each size as it is done
    from bench.tools.report import control
    print(control(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
