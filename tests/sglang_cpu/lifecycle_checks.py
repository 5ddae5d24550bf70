"""Engine-lifecycle checks of our ``SGLangEngine`` against the real ``sglang.Engine`` (0.5.23) on CPU.

Run by ``host_checks.py`` on rank 0's TP-1 engine: the engine starts under torchrun's c10d
rendezvous (whose TORCHELASTIC_USE_AGENT_STORE the engine host must not inherit); the KV capacity
and load the backend reports come from the engine (not our estimate);
memory is released only once every aborted request has come back and the engine is idle:
released too early, sglang's scheduler asserts and kills the engine host.
"""
from __future__ import annotations

import os
import threading
import time

LONG_TOKENS = 400  # long enough to still be decoding when the abort lands (about 1 s per 100 on CPU)


def progress(name: str, value) -> None:
    """One line per finished check: if a later step kills the process (sglang SIGQUITs its parent
    when its scheduler asserts), the output still says how far it got."""
    print(f"PROGRESS {name}: {value!r}", flush=True)


def _main_thread_times() -> tuple[float, float]:
    """This thread's seconds on a CPU and waiting in a run queue (``/proc/thread-self/schedstat``)."""
    try:
        on_cpu, waiting, _ = open("/proc/thread-self/schedstat").read().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return float("nan"), float("nan")


def wait_until_running(eng, n: int, timeout_s: float = 30.0):
    """Block until ``stats()`` (the scheduler's load snapshot, read in the engine host) reports ``n``
    running requests, so that an abort hits running ones. On a timeout, the slowest read says where
    its time went: on this thread's CPU, waiting for one, or neither (blocked), with every thread's
    stack if it took over a second. (Reading sglang's own snapshot object here instead once made
    the first read import sglang into this process: 1-4 s on a loaded machine, by which time the
    requests had finished.)"""
    import faulthandler
    import tempfile

    started = time.monotonic()
    seen: dict[tuple[int, int], float] = {}  # (running, waiting) -> seconds after the start it was first read
    slowest = (0.0, "")
    with tempfile.TemporaryFile("w+") as stacks:
        while time.monotonic() < started + timeout_s:
            t0, (cpu0, queued0) = time.monotonic(), _main_thread_times()
            stacks.seek(0)
            stacks.truncate()
            faulthandler.dump_traceback_later(1.0, file=stacks)
            try:
                load = eng.stats()
            finally:
                faulthandler.cancel_dump_traceback_later()
            took, (cpu1, queued1) = time.monotonic() - t0, _main_thread_times()
            if took > slowest[0]:
                stacks.seek(0)
                slowest = (took, f"the slowest read took {took:.2f} s from {t0:.2f} (monotonic): {cpu1 - cpu0:.2f} s on "
                                 f"a CPU, {queued1 - queued0:.2f} s waiting for one; threads after 1 s:\n{stacks.read()}")
            if load.running >= n and load.extra["load_snapshot"]:
                return load
            seen.setdefault((load.running, load.waiting), round(time.monotonic() - started, 2))
            time.sleep(0.05)
    from engine_checks import stall_report
    raise TimeoutError(f"the engine never reported {n} running requests: last load {eng.stats()}\n"
                       f"(running, waiting) first read after s: {seen}, from {started:.2f} (monotonic)\n"
                       f"{slowest[1]}\nthe engine host's state:\n{stall_report(eng)}")


def lifecycle_checks(eng, prompts, want) -> dict:
    """Submit long requests; while they run, check the reported stats (not our estimate); then abort them all
    and release memory at once; after resume, greedy output must still equal ``want``."""
    from engine_checks import CPU_ENGINE_ARGS, backend_generate, compare
    from rollpacker.rollout.engine import MEMORY_TAGS, GenerationRequest, SamplingParams

    verdict: dict = {}
    capacity = CPU_ENGINE_ARGS["max_total_tokens"]
    idle = eng.stats()
    verdict["stats_kv_capacity_is_the_engines"] = (
        True if idle.kv_tokens_capacity == capacity > 0
        else f"stats().kv_tokens_capacity = {idle.kv_tokens_capacity}; the engine holds {capacity} KV tokens")
    progress("stats_kv_capacity_is_the_engines", verdict["stats_kv_capacity_is_the_engines"])

    params = SamplingParams(temperature=0.0, max_new_tokens=LONG_TOKENS)
    eng.submit([GenerationRequest(f"long-{i}", ids, params) for i, ids in enumerate(prompts)])
    load = wait_until_running(eng, len(prompts))
    time.sleep(0.3)  # a few decode steps: every request holds KV beyond its prompt
    busy = eng.stats()
    verdict["stats_report_engine_load"] = (
        True if busy.kv_tokens_used > 0 and busy.running == len(prompts) and busy.waiting == 0
        else f"while the engine ran {load.running} requests on {load.kv_tokens_used} KV tokens, "
             f"stats() said running={busy.running} waiting={busy.waiting} kv_tokens_used={busy.kv_tokens_used}")
    progress("stats_report_engine_load", verdict["stats_report_engine_load"])

    # Release at once after abort_all: were it sent while sglang still held an aborted request, its
    # scheduler would assert is_fully_idle() and SIGQUIT the engine host, and the call would raise.
    eng.abort_all()
    started = time.monotonic()
    try:
        eng.release_memory(list(MEMORY_TAGS))
        verdict["release_after_abort_waits_for_idle"] = True
    except Exception as exc:  # noqa: BLE001 - reported
        verdict["release_after_abort_waits_for_idle"] = f"release_memory right after abort_all raised {exc!r}"
    progress("release_after_abort_waits_for_idle", round(time.monotonic() - started, 2))
    eng.resume_memory(list(MEMORY_TAGS))
    leftover = eng.poll(0.5)
    verdict["aborted_requests_never_surface"] = (
        True if not leftover else f"poll returned {[c.request_id for c in leftover]} after abort_all")
    verdict["greedy_after_release_resume_matches_transformers"] = compare(
        "after abort, release and resume", backend_generate(eng, "c", prompts), want)
    verdict["doorbell_rings_once_a_request_finishes"] = doorbell_check(eng, prompts[0])
    progress("doorbell_rings_once_a_request_finishes", verdict["doorbell_rings_once_a_request_finishes"])
    verdict["evicted_then_resumed_equals_greedy"] = evict_resume_check(eng, prompts)
    progress("evicted_then_resumed_equals_greedy", verdict["evicted_then_resumed_equals_greedy"])
    return verdict


def evict_resume_check(eng, prompts) -> bool | str:
    """Migration by recompute on the real engine (a stream trainer's hand-off): requests evicted
    mid-decode come back with their tokens so far, and resubmitted with them they end as the greedy
    outputs of requests that never moved."""
    from engine_checks import backend_generate, compare
    from rollpacker.rollout.engine import FINISH_EVICTED, GenerationRequest, SamplingParams

    want = backend_generate(eng, "stay", prompts, max_new_tokens=LONG_TOKENS)
    params = SamplingParams(temperature=0.0, max_new_tokens=LONG_TOKENS)
    requests = {f"move-{i}": GenerationRequest(f"move-{i}", ids, params) for i, ids in enumerate(prompts)}
    eng.submit(list(requests.values()))
    wait_until_running(eng, len(prompts))
    time.sleep(0.2)  # a few tokens in: the resumed part is not the whole output
    handed = eng.evict(list(requests))
    partial = [c for c in handed if c.finish_reason == FINISH_EVICTED]
    done = {c.request_id: list(c.output_ids) for c in handed if c.finish_reason != FINISH_EVICTED}
    if not partial or not any(len(c.output_ids) for c in partial):
        return f"no request was evicted mid-decode: {[(c.request_id, c.finish_reason, len(c.output_ids)) for c in handed]}"
    eng.submit([requests[c.request_id].resumed_from(c) for c in partial])
    deadline = time.monotonic() + 120
    while len(done) < len(prompts) and time.monotonic() < deadline:
        done.update((c.request_id, list(c.output_ids)) for c in eng.poll(timeout=1.0))
    return compare("evicted, then resumed", [done.get(f"move-{i}", []) for i in range(len(prompts))], want)


def doorbell_check(eng, prompt) -> bool | str:
    """The engine's ready descriptor (its host writes to it per result) turns readable once a
    request finishes, without a poll, and a poll reads it empty: a server sleeps on it instead of
    polling the host (``EngineServer.serve``)."""
    import select

    from rollpacker.rollout.engine import GenerationRequest, SamplingParams

    fd = eng.ready_fd()
    if fd is None:
        return "the SGLang engine has no ready descriptor"

    def settle() -> str | None:
        """Poll until the descriptor stays quiet for 0.5 s. The host queues a result and rings next, so
        a poll may take a result whose ring lands after it, seconds later on a loaded machine (seen in
        stress runs): a ring may be spurious, never missing, and a poll reads whatever has landed."""
        for _ in range(20):
            stray = eng.poll(0.0)
            if stray:
                return f"a poll with nothing in flight returned {[c.request_id for c in stray]}"
            if not select.select([fd], [], [], 0.5)[0]:
                return None
        return "the ready descriptor kept turning readable with nothing in flight"

    problem = settle()
    if problem:
        return problem
    eng.submit([GenerationRequest("bell", prompt, SamplingParams(temperature=0.0, max_new_tokens=8))])
    rang = bool(select.select([fd], [], [], 120)[0])  # settled before: this ring is the bell's
    done = [c.request_id for c in eng.poll(0.0)]
    problem = settle()
    return True if rang and done == ["bell"] and problem is None else (
        f"rang: {rang}; the poll after it returned {done}; then: {problem or 'quiet'}")


def start_under_torchrun(start, verdict: dict):
    """``start()`` the backend's first engine in this torchrun worker (``torch.distributed.run
    --standalone``, a c10d rendezvous, which sets TORCHELASTIC_USE_AGENT_STORE=True): the engine must
    come up, and the worker's own environment must be left as torchrun set it."""
    before = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    verdict["under_torchrun_agent_store"] = (
        True if before == "True"
        else f"TORCHELASTIC_USE_AGENT_STORE={before!r}: not run as a c10d torchrun worker, C2 is not checked")
    watchdog = threading.Timer(START_TIMEOUT_S, give_up, args=(verdict,))
    watchdog.daemon = True
    watchdog.start()
    eng = start()
    watchdog.cancel()
    verdict["engine_starts_under_torchrun"] = True
    after = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    verdict["worker_env_restored"] = True if after == before else f"TORCHELASTIC_USE_AGENT_STORE is now {after!r}"
    return eng


# The engine starts in 13-16 s on idle cores (minutes on loaded ones, beside rank 1's engines); a
# scheduler waiting for a store server waits 30 min.
START_TIMEOUT_S = 300


def give_up(verdict: dict) -> None:
    """The engine did not come up: report it, kill the schedulers this process spawned, and exit."""
    import json

    import psutil

    verdict["engine_starts_under_torchrun"] = f"sglang.Engine did not start within {START_TIMEOUT_S}s"
    print("VERDICT " + json.dumps({"backend": verdict}), flush=True)
    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(3)
