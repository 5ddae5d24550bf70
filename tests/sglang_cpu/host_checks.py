"""Every check against the real ``sglang.Engine`` (0.5.23) on CPU, in one torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node 2 host_checks.py MODEL_DIR BASE_PORT

One launch serves three tests (each engine start costs about three sglang imports, tens of seconds
of CPU). Rank 0 computes the transformers reference once (``engine_checks.Reference``) and
shares it. As ``EngineSets`` builds them, rank 0 leads a TP-1 engine and the TP-2 engine of ranks
{0, 1}; rank 1 leads its own TP-1 engine. The verdict has one section per test:

- ``engine`` (rank 1, before its own engine, since ``sglang.Engine.shutdown`` kills every child of
  its process): ``sglang.Engine`` driven directly, ``engine_checks.check_engine``;
- ``backend`` (rank 0's TP-1 engine, first in its life): it starts in a c10d torchrun worker,
  then ``engine_checks.check_backend`` and ``lifecycle_checks``;
- ``race`` (the same engine, next): the deterministic race's progress counts and short rounds,
  ``race_checks``;
- ``hosts`` (rank 0, after ``backend``):
  - each engine runs in a host process of its own (sglang keeps one live config per process),
    and after a weight push to each, both generate what transformers does with the pushed weights
    (the TP-1 engine, which serves the perturbed weights by now, gets the shipped ones back);
  - shutting the TP-2 engine down ends its host and sglang's processes under it, and leaves
    the rank's other children (a stand-in for the reward workers) and the TP-1 engine running;
  - a SIGTERM to the rank and to its engine host reaches our handler, and the engine keeps
    serving (sglang's own SIGTERM watchdog would exit the process);
  - a dead sglang scheduler makes ``poll(None)`` raise ``EngineDiedError`` instead of waiting forever.

A section whose checks raise gets ``crashed`` (the traceback) and the next one still runs. The
last stdout line of rank 0 is ``VERDICT {json}``: ``reference``, ``engine``, ``backend``, ``race``,
``hosts``.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import psutil
import torch.distributed as dist

from engine_checks import (CPU_ENGINE_ARGS, STALL_DUMP_ENV, STALLS, Reference, backend_generate, check_backend,
                           check_engine, compare, reference)
from lifecycle_checks import start_under_torchrun
from race_checks import race_checks

DEATH_TIMEOUT_S = 60  # the host's watch notices a dead sglang process within about a second
IDLE_S, IDLE_CPU_SHARE = 2.0, 0.25  # an idle engine's process may use a quarter of a core (it uses ~1%)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def pidfds(pids: set[int]) -> dict[int, int]:
    """pid -> a pidfd of it, for those still running."""
    fds = {}
    for pid in pids:
        try:
            fds[pid] = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
    return fds


def still_running(fds: dict[int, int], timeout: float) -> list[int]:
    """The pids of ``fds`` whose process has not ended within ``timeout`` (a pidfd turns readable when its
    process ends); closes the fds."""
    deadline, waiting = time.monotonic() + timeout, dict(fds)
    while waiting and (left := deadline - time.monotonic()) > 0:
        ended, _, _ = select.select(list(waiting.values()), [], [], left)
        waiting = {pid: fd for pid, fd in waiting.items() if fd not in ended}
    for fd in fds.values():
        os.close(fd)
    return sorted(waiting)


def ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores signal ``signum`` (its SigIgn mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise ValueError(f"no SigIgn in /proc/{pid}/status")


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = {int(c) for c in task.read_text().split()}
            except OSError:
                continue
            todo.extend(kids - out)
            out |= kids
    return out


def idle_cpu_seconds(hosts: list[int], seconds: float) -> dict[str, float]:
    """CPU seconds each process of the engines under ``hosts`` (hosts, schedulers, detokenizers)
    uses over ``seconds`` in which nothing is asked of them."""
    procs = [psutil.Process(pid) for pid in sorted(set(hosts).union(*(descendants(h) for h in hosts)))]
    before = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    time.sleep(seconds)
    return {f"{p.name()}[{p.pid}]": round(sum(p.cpu_times()[:2]) - before[p.pid], 3) for p in procs}


def host_checks(ref: Reference, tp1, tp2) -> dict:
    from rollpacker.rollout.engine import GenerationRequest, SamplingParams
    from rollpacker.rollout.sglang_backend import EngineDiedError

    verdict: dict = {}
    prompts = ref.prompts
    pids = {"rank": os.getpid(), "tp1_host": tp1.host_pid, "tp2_host": tp2.host_pid}
    verdict["one_engine_per_process"] = (
        True if len(set(pids.values())) == 3 else f"engines share a process: {pids}")

    # Each push changes what its engine generates: TP-1 serves the new weights since check_backend.
    for name, eng, weights, want in (("tp1", tp1, ref.old_weights, ref.want_before),
                                     ("tp2", tp2, ref.new_weights, ref.want_after)):
        eng.update_weights(iter(weights))
        verdict[f"{name}_greedy_after_push_matches_transformers"] = compare(
            f"{name} after push", backend_generate(eng, f"{name}-a", prompts), want)

    # Idle engines sleep (``sleep_on_idle``): a spinning scheduler would take a whole core, IDLE_S CPU
    # seconds over IDLE_S seconds, from the trainer and the reward workers on the same node.
    used = idle_cpu_seconds([tp1.host_pid, tp2.host_pid], IDLE_S)
    verdict["idle_engine_cpu_seconds"] = used
    busiest = max(used.values())
    verdict["idle_engines_sleep"] = (
        True if busiest < IDLE_CPU_SHARE * IDLE_S
        else f"over {IDLE_S}s with no request, a process of the idle engines used {busiest:.2f} CPU s: {used}")

    # The rank's other children survive an engine's shutdown.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    tp2_tree = {tp2.host_pid} | descendants(tp2.host_pid)
    exits = pidfds(tp2_tree)  # opened before the shutdown: no pid reused meanwhile is waited for
    tp2.shutdown()
    left = still_running(exits, DEATH_TIMEOUT_S)
    verdict["shutdown_ends_the_engines_processes"] = (
        True if not left else f"still alive {DEATH_TIMEOUT_S}s after shutdown: {left}")
    verdict["shutdown_spares_the_ranks_other_children"] = (
        True if bystander.poll() is None else f"the rank's child exited with {bystander.returncode}")
    bystander.kill()
    bystander.wait()

    # SIGTERM to the rank (our handler) and to its engine host (as Slurm signals a whole step). The
    # host ignores it: the kernel drops a signal whose disposition is SIG_IGN when it is sent, so there
    # is nothing to wait for there; sglang's own handler would show as a disposition that is not SIG_IGN.
    got = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: got.set())
    host_ignores = ignores(tp1.host_pid, signal.SIGTERM)
    os.kill(tp1.host_pid, signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    got.wait(DEATH_TIMEOUT_S)
    signal.signal(signal.SIGTERM, previous)
    verdict["sigterm_reaches_our_handler"] = True if got.is_set() else "our SIGTERM handler never ran"
    verdict["engine_host_ignores_sigterm"] = (
        True if host_ignores and alive(tp1.host_pid) else "the engine host handles SIGTERM (sglang's watchdog)")
    verdict["engine_serves_after_sigterm"] = compare(
        "tp1 after SIGTERM", backend_generate(tp1, "tp1-b", prompts), ref.want_before)

    # A dead scheduler: poll(None) must raise, not wait forever.
    tp1.submit([GenerationRequest(f"long-{i}", ids, SamplingParams(temperature=0.0, max_new_tokens=900))
                for i, ids in enumerate(prompts)])
    schedulers = sorted(descendants(tp1.host_pid))
    os.kill(schedulers[0], signal.SIGKILL)
    outcome: dict = {}

    def wait() -> None:
        try:
            while True:
                tp1.poll(None)
        except EngineDiedError as exc:
            outcome["raised"] = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported
            outcome["other"] = repr(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    started = time.monotonic()
    waiter.start()
    waiter.join(DEATH_TIMEOUT_S)
    verdict["dead_scheduler_raises_instead_of_hanging"] = (
        True if "raised" in outcome else
        f"poll(None) still waiting {DEATH_TIMEOUT_S}s after sglang process {schedulers[0]} was killed"
        if waiter.is_alive() else f"poll raised {outcome.get('other')}")
    verdict["seconds_to_notice_death"] = round(time.monotonic() - started, 1)
    return verdict


def section(verdict: dict, name: str, checks: Callable[[dict], None]) -> None:
    """Run ``checks`` into ``verdict[name]``; a raise is reported there and the run goes on."""
    part = verdict.setdefault(name, {})
    try:
        checks(part)
    except Exception:  # noqa: BLE001 - the pytest side reports it
        part["crashed"] = traceback.format_exc()
    if STALLS:  # a generation that timed out: what its engine host was waiting on
        part["stalled_generations"] = dict(STALLS)
        STALLS.clear()


def main(model_dir: Path, base_port: int) -> dict | None:
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.sglang_backend import SGLangEngine

    dist.init_process_group("gloo", timeout=timedelta(minutes=20))
    rank = dist.get_rank()
    shared = [reference(model_dir) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    ref: Reference = shared[0]
    pair = dist.new_group([0, 1])
    verdict: dict = {"reference": ref.verdict()}
    if rank == 1:
        section(verdict, "engine", lambda part: part.update(check_engine(model_dir, ref)))
    cfg = RolloutConfig(backend="sglang", sglang_base_port=base_port,
                        kv_cache_tokens=CPU_ENGINE_ARGS["max_total_tokens"])

    def start_tp1():
        return SGLangEngine(model_dir, cfg, engine_id=rank, device="cpu")

    engines = []
    try:
        engines.append(start_under_torchrun(start_tp1, verdict.setdefault("backend", {})) if rank == 0
                       else start_tp1())
        engines.append(SGLangEngine(model_dir, cfg, group=pair, engine_id=0, device="cpu"))
        if rank == 0:
            tp1, tp2 = engines
            section(verdict, "backend", lambda part: check_backend(tp1, ref, part))
            section(verdict, "race", lambda part: part.update(race_checks(tp1, ref.prompts)))
            section(verdict, "hosts", lambda part: part.update(host_checks(ref, tp1, tp2)))
    finally:
        dist.barrier()
        for eng in reversed(engines):
            eng.shutdown()
    engine_verdicts = [None, None] if rank == 0 else None
    dist.gather_object(verdict.get("engine"), engine_verdicts, dst=0)
    dist.destroy_process_group()
    if rank != 0:
        return None
    verdict["engine"] = engine_verdicts[1]
    return verdict


if __name__ == "__main__":
    started = time.monotonic()
    os.environ[STALL_DUMP_ENV] = tempfile.mkdtemp(prefix="stall-dump-")  # inherited by the engine hosts
    try:
        result = main(Path(sys.argv[1]), int(sys.argv[2]))
    except Exception:  # noqa: BLE001 - the pytest side reports it
        result = {"crashed": traceback.format_exc()}
    finally:
        shutil.rmtree(os.environ[STALL_DUMP_ENV], ignore_errors=True)
    if result is not None:
        result["seconds"] = round(time.monotonic() - started, 1)
        print("VERDICT " + json.dumps(result), flush=True)
