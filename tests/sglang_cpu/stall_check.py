"""Repeat the real-engine fixture's weight-update refusal, each followed by a generation, and watch for a stall.

    PYTHONPATH=$PWD .cache/sglang-cpu/venv/bin/python -m tests.sglang_cpu.stall_check --repeats 20 [--mode backend]
    PYTHONPATH=$PWD .cache/sglang-cpu/venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m tests.sglang_cpu.stall_check --repeats 20 --mode by-rank

(the venv's python: ``python tests/sglang_cpu/env.py`` prints its path). A script, not a test.

- ``--mode engine`` (default): ``sglang.Engine`` in this process, as ``engine_checks.check_engine`` drives
  it: ``update_weights_from_tensor`` outside a session must answer ``(False, "...begin_weight_update...")``;
- ``--mode backend``: our ``SGLangEngine`` (engine host process), as ``engine_checks.check_backend`` does:
  ``refusal_surfaces`` (a session opened behind the backend's back, so its ``update_weights`` must raise);
- ``--mode by-rank``: under torchrun, the fixture's layout (``host_checks.py``): rank 0 ``backend``, the
  other ranks ``engine``, all at once.

The TP-1 engine starts once (``--fresh``: once per repeat) and serves one greedy generation, as in the
fixture. Once is enough: a refusal leaves the engine as it was (the scheduler answers before it touches
any state, ``managers/scheduler_components/weight_updater.py:234``; the tokenizer manager takes and
releases its writer lock), so every repeat takes the path of the fixture's single refusal. Then, per
repeat, the refusal and a greedy generation of ``engine_checks.PROMPTS``, which must equal transformers'
(a refusal changes no weight). A generation past ``--deadline`` seconds is a stall:
the script dumps this process's threads, the engine loop's asyncio tasks and request states, and, through
SIGUSR1 (``faulthandler``, registered in every process it starts by a ``sitecustomize`` on their path),
the stacks of the engine host and sglang's processes, then exits 2. One line per repeat (with the open
file descriptors of the process that holds the ``sglang.Engine``), then ``SUMMARY {json}``.
"""
from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
POLICY = HERE.parents[1] / "assets" / "policy"
SITECUSTOMIZE = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"


def say(line: str) -> None:
    print(f"[rank {os.environ['RANK']}] {line}" if "RANK" in os.environ else line, flush=True)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def descendants(pid: int) -> list[int]:
    import psutil
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def dump_processes(pids: list[int]) -> None:
    """State and kernel wait channel of each process, then its Python stacks (SIGUSR1, on its stderr)."""
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
        say(f"  pid {pid} state {stat} wchan {wchan!r}: {cmd}")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
        time.sleep(1.0)  # one dump at a time on the shared stderr


def dump_engine_loop(engine) -> None:
    """The asyncio tasks of sglang's engine loop and the tokenizer manager's open requests (read from
    another thread: for a diagnosis only)."""
    tasks = list(asyncio.all_tasks(engine.loop))
    say(f"  engine loop: running={engine.loop.is_running()}, {len(tasks)} tasks")
    for task in tasks:
        task.print_stack(limit=8, file=sys.stdout)
    for rid, state in list(engine.tokenizer_manager.rid_to_state.items()):
        say(f"  request {rid}: finished={getattr(state, 'finished', '?')} "
            f"outputs={len(getattr(state, 'out_list', []))} event_set={state.event.is_set()}")


def stall(index: int, waited: float, dump) -> None:
    SUMMARY.update(stalls=1, stall_repeat=index)
    say(f"STALL repeat {index}: no generation after {waited:.0f} s; where things are:")
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    dump()


class DirectEngine:
    """``sglang.Engine`` in this process (``--mode engine``)."""

    def __init__(self, ref):
        import sglang

        from engine_checks import CPU_ENGINE_ARGS, without_agent_store
        self.ref, self.pid = ref, os.getpid()
        with without_agent_store():  # under torchrun: see engine_checks
            self.engine = sglang.Engine(model_path=str(POLICY), **CPU_ENGINE_ARGS)

    def refuse(self) -> bool | str:
        ok, msg = self.engine.update_weights_from_tensor(named_tensors=self.ref.new_weights, flush_cache=True)
        return True if ok is False and "begin_weight_update" in msg else f"returned {(ok, msg)!r}"

    def generate(self, index: int, deadline: float) -> list[list[int]]:
        from engine_checks import engine_greedy

        def on_deadline() -> None:  # the main thread is stuck in run_until_complete
            stall(index, deadline, self.dump)
            finish(2)
        watchdog = threading.Timer(deadline, on_deadline)
        watchdog.daemon = True
        watchdog.start()
        try:
            return engine_greedy(self.engine, self.ref.prompts)
        finally:
            watchdog.cancel()

    def dump(self) -> None:
        dump_engine_loop(self.engine)
        dump_processes(descendants(os.getpid()))

    def shutdown(self) -> None:
        self.engine.shutdown()


class BackendEngine:
    """Our ``SGLangEngine``, its engine in a host process (``--mode backend``)."""

    def __init__(self, ref):
        from engine_checks import CPU_ENGINE_ARGS
        from rollpacker.rollout.config import RolloutConfig
        from testkit import free_base_port
        from rollpacker.rollout.sglang_backend import SGLangEngine
        self.ref, self.calls = ref, 0
        cfg = RolloutConfig(backend="sglang", sglang_base_port=free_base_port(1),
                            kv_cache_tokens=CPU_ENGINE_ARGS["max_total_tokens"])
        self.eng = SGLangEngine(POLICY, cfg, engine_id=0, device="cpu")
        self.pid = self.eng.host_pid

    def refuse(self) -> bool | str:
        from engine_checks import refusal_surfaces
        return refusal_surfaces(self.eng, self.ref.new_weights)

    def generate(self, index: int, deadline: float) -> list[list[int]]:
        from engine_checks import backend_generate
        self.calls += 1
        out = backend_generate(self.eng, f"r{self.calls}", self.ref.prompts, timeout_s=deadline)
        if not all(out):
            stall(index, deadline, self.dump)
            finish(2)
        return out

    def dump(self) -> None:
        from engine_checks import stall_report
        load: dict = {}
        reader = threading.Thread(target=lambda: load.update(v=self.eng.stats()), daemon=True)
        reader.start()
        reader.join(40)
        say(f"  scheduler load (through the host): {load.get('v', 'no answer within 40 s')}")
        say(f"  the engine host's own account:\n{stall_report(self.eng)}")
        host = self.eng.host_pid
        dump_processes([host, *descendants(host)])

    def shutdown(self) -> None:
        self.eng.shutdown()


SUMMARY: dict = {}
SITE: list[Path] = []  # holds the sitecustomize of the processes this one starts


def finish(code: int) -> None:
    """Print the summary; on a stall, kill what this process started and exit at once."""
    gen = SUMMARY.pop("_gen_s", [])
    if gen:
        SUMMARY["generation_s"] = dict(min=round(min(gen), 3), median=round(statistics.median(gen), 3),
                                       max=round(max(gen), 3))
    say("SUMMARY " + json.dumps(SUMMARY))
    for site in SITE:  # the processes it served have started (and are gone, or killed below)
        shutil.rmtree(site, ignore_errors=True)
    if code:
        import psutil
        for child in psutil.Process().children(recursive=True):
            child.kill()
        os._exit(code)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--mode", choices=("engine", "backend", "by-rank"), default="engine")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds a generation may take")
    parser.add_argument("--fresh", action="store_true", help="a new engine for every repeat")
    args = parser.parse_args()

    from tests.sglang_cpu.env import ENGINE_ENV
    os.environ.update(ENGINE_ENV)
    SITE.append(Path(tempfile.mkdtemp(prefix="stall-check-")))  # every process started from here: SIGUSR1 dumps
    (SITE[0] / "sitecustomize.py").write_text(SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE[0]), os.environ.get("PYTHONPATH")) if p)
    os.environ["ROLLPACKER_STALL_DUMP_DIR"] = str(SITE[0])  # shims/rollpacker_stall_dump.py, in the engine hosts
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.path.insert(0, str(HERE))  # engine_checks and lifecycle_checks import each other by bare name
    from engine_checks import compare, reference

    t0 = time.monotonic()
    ref = reference(POLICY)
    mode = args.mode if args.mode != "by-rank" else "backend" if os.environ.get("RANK", "0") == "0" else "engine"
    kind = DirectEngine if mode == "engine" else BackendEngine
    SUMMARY.update(mode=mode, fresh=args.fresh, repeats=args.repeats, deadline_s=args.deadline,
                   refusals_ok=0, generations=0, outputs_match=0, stalls=0, tokens=0, engine_start_s=[],
                   _gen_s=[])
    engine = None
    try:
        for i in range(-1, args.repeats):  # -1: the fixture's generation before its refusal
            if engine is None or (args.fresh and i >= 0):
                if engine is not None:
                    engine.shutdown()
                started = time.monotonic()
                engine = kind(ref)
                SUMMARY["engine_start_s"].append(round(time.monotonic() - started, 1))
            refused = engine.refuse() if i >= 0 else "-"
            started = time.monotonic()
            out = engine.generate(i, args.deadline)
            seconds = time.monotonic() - started
            match = compare(f"repeat {i}", out, ref.want_before)
            tokens = sum(map(len, out))
            say(f"repeat {i:3d}  refusal {refused}  generation {seconds:6.2f} s  {tokens} tokens  "
                f"greedy {'ok' if match is True else match}  engine-process fds {open_fds(engine.pid)}")
            if i >= 0:
                SUMMARY["refusals_ok"] += refused is True
                SUMMARY["generations"] += 1
                SUMMARY["outputs_match"] += match is True
                SUMMARY["tokens"] += tokens
                SUMMARY["_gen_s"].append(seconds)
    finally:
        if engine is not None:
            engine.shutdown()
    SUMMARY["seconds"] = round(time.monotonic() - t0, 1)
    finish(0)
    ok = SUMMARY["refusals_ok"] == SUMMARY["outputs_match"] == args.repeats
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
