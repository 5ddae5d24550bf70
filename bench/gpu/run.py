"""The GPU acceptance run as one prepared device call, inside a fixed time budget.

A lent GPU window is 15 minutes of device time in all and one command may run 10 minutes, so one
call carries the working tree, the SGLang 0.5.17 bundle (``bench/tools/sglang_bundle.py``) and ``.whl/``
(``bench/gpu/wheels.sh``) and runs::

    python3 -m bench.gpu.run --bundle .bundle/sglang-0.5.17 --budget-s 540 --out $OUT

It unpacks the bundle and installs the wheels under ``--work`` (default /tmp/gpu-run; the machine's
/tmp is lost when it is given back), runs the bundle's import check (``bench.tools.sglang_imports``), then
the checks of ``bench/gpu/acceptance.py`` in ``priority`` order, each in a process of its own
(``bench.gpu.acceptance check``) with its own time limit from ``GPU_BUDGETS_S``. A check starts only if its
budget fits in what is left of ``--budget-s``; one that runs past its budget is killed with every
process it started and recorded as timed out, with the stages it finished (the SGLang engine check
and the programs write their result after each stage). ``OUT/summary.json`` and ``summary.md`` are
rewritten after every step, so a call cut short keeps what finished. OUT gets at most
``MAX_OUT_FILES`` small files (summary, log, the trainer profiles, the programs' metrics); models,
sites and logs stay in the work folder.

The CPU dry run of the same command (the suite runs it: tests/integration/test_gpu_run.py) takes ``--device cpu``,
the CPU dry run's tiny shapes and budgets, and sglang from the interpreter's environment when no
bundle is given. ``--plan`` prints the steps and budgets without running anything.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit import kill_group

REPO = Path(__file__).resolve().parents[2]
MAX_OUT_FILES = 8
LOG_TAIL_LINES = 40  # of a step that failed or timed out, into OUT/log.txt
GONE_WAIT_S = 30.0  # longest wait for a killed check's processes to be gone (its device memory freed)

# Setup, whatever the device: each a limit, not a reservation (the run goes on with what is left).
# Expected on a fresh GPU machine, the first minute: the bundle (52 MB of zstd, 359 MB installed:
# the pruned 0.5.17 set; the full 699 MB set unpacked in 40 s with every RECORD checked on this
# repository's 2-core machine, docs/gpu/README.md) ~15 s; the wheels (megatron-core, pyzmq,
# math-verify and its requirements) ~5 s; the import check (sglang's Engine path: torch, triton,
# transformers, flashinfer's Python side, cold) ~20-30 s. sglang's RoPE kernel is compiled (nvcc
# via tvm_ffi, ~30-60 s) within the first engine start, the first check's budget.
SETUP_BUDGETS_S = {"setup/unpack": 150, "setup/wheels": 60, "setup/sglang_imports": 120}

# Per check on an H100, seconds: the kill limit and what must be left to start it. Measured ones are
# about 1.5x the slower of runs 1 and 3 of docs/gpu/2026-11-23-h100-b (its logs' per-check seconds),
# rounded up; the others (never yet run on a GPU) are estimates from their parts, as noted.
GPU_BUDGETS_S = {
    # estimate: random 0.5B model written (~10 s), engine start with CUDA graphs (~30-50 s) plus the
    # RoPE JIT of a fresh machine (nvcc via tvm_ffi, ~30-60 s), transformers' greedy twice (~10 s), a
    # trainer (~15 s, as logprob_parity's 21-23 s), the pushes and release/resume: ~160 s
    "qwen2.5-0.5b-shape/sglang_engine": 240,
    # estimate: the reference-engine program took 111-127 s (two torchrun runs of 10 steps, ~48 s
    # each, 20 s of them steps); on SGLang each run also starts an engine for the tiny policy (~30-40
    # s: sglang's processes, CUDA graphs; the RoPE kernel is compiled by then) and releases, resumes
    # and pushes weights to it every step: ~190 s
    "program/sglang_baseline_vs_tail_batching": 250,
    # estimate: an sglang start for the tiny policy (~30-40 s, the RoPE kernel compiled by then), two
    # runs of 3 short rounds and the long rounds between them at P0=8, R0=4, 128 tokens (~10 s each)
    "policy/sglang_race_ledger": 120,
    # estimates: writing the 0.6e9-parameter random MoE (~10 s) then as the dense checks of its size; the
    # engine check also compares the routing (a transformers forward per request) and reads transformers'
    # model again after the push (its experts are fused: ~5 GB of fp32 written and read, ~30 s)
    "qwen3-moe-widths-2l/logprob_parity": 60,
    "qwen3-moe-widths-2l/sglang_engine": 270,
    "qwen3-moe-widths-2l/trainer_throughput": 90,
    # estimate: two runs of 5 steps at P0=32, R0=8 on the 0.5B shape with replayed lengths (limit 1,024,
    # median 37): a baseline step decodes ~1,000 steps at ~10 ms, ~10 s; torchrun and model load ~40 s each
    "program/replay_baseline_vs_tail_batching": 200,
    "program/sglang_replay_baseline_vs_tail_batching": 240,
    # estimate: a 2.0B-parameter random model made and written as 8 GB of fp32 (~20-30 s), loaded
    # (~15-25 s), an optimizer step, 8 micro-batches of 8,192 tokens (~0.3 s each), the profile: ~80 s
    "qwen2.5-7b-widths-4l/trainer_throughput": 120,
    "qwen2.5-0.5b-shape/trainer_throughput": 45,  # 26.0 / 23.6 s, plus the profile's two micro-batches
    "attention/packed_kernels": 60,  # estimate: compiles FlexAttention, a few fp32 references
    # estimate: engine_throughput's 33 s for the reference engine, an sglang start (~40-60 s), its batches
    "qwen2.5-0.5b-shape/sglang_throughput": 150,
    "qwen2.5-0.5b-shape/offload_and_optimizer_state": 70,  # 44.4 / 43.9 s
    "policy/sglang_engine": 120,  # estimate: as the 0.5B one, a tiny model, the JIT cached
    "policy/logprob_parity": 35,  # 21.2 / 17.0 s
    "policy/gradient_parity": 55,  # 34.6 / 27.5 s
    "policy/loss_falls": 30,  # 19.9 / 17.1 s
    "policy/offload_and_optimizer_state": 35,  # 20.7 / 17.2 s
    "policy/engine_greedy_parity": 40,  # 23.9 / 19.3 s
    "qwen2.5-0.5b-shape/logprob_parity": 40,  # 23.1 / 21.5 s (26.3 s in run 2)
    "qwen2.5-0.5b-shape/gradient_parity": 90,  # 54.3 / 57.1 s (60.8 s in run 2)
    "qwen2.5-0.5b-shape/loss_falls": 30,  # 19.5 / 19.4 s
    "qwen2.5-0.5b-shape/engine_greedy_parity": 45,  # 28.5 / 26.7 s
    "qwen2.5-0.5b-shape/engine_throughput": 50,  # 33.4 / 31.5 s
    "qwen2.5-0.5b-shape/weight_sync": 30,  # 18.3 / 15.6 s
    "qwen2.5-0.5b-shape/host_weight_transport": 45,  # 28.7 s (run 4, its only run)
    "program/baseline_vs_tail_batching": 190,  # 126.9 / 110.8 s
}
# The CPU dry run's checks (tiny shapes), seconds: about 2-3x the slowest each took on this
# repository's 2-core machine under a load average of 7 (2026-11-27: the SGLang engine check 259 s,
# the reference engine's greedy parity 104 s, the others 28-53 s); they bound a dry run, no figure.
CPU_BUDGETS_S = {
    "policy/sglang_engine": 600,
    "program/sglang_baseline_vs_tail_batching": 900,
    "tiny-widths/trainer_throughput": 150,
    "tiny-random/trainer_throughput": 150,
    "tiny-random/sglang_throughput": 600,
    "policy/logprob_parity": 150,
    "policy/gradient_parity": 150,
    "policy/loss_falls": 150,
    "policy/offload_and_optimizer_state": 150,
    "policy/engine_greedy_parity": 300,
    "tiny-random/engine_throughput": 150,
    "tiny-random/weight_sync": 150,
    "tiny-random/host_weight_transport": 150,
    "program/baseline_vs_tail_batching": 900,
    "program/replay_baseline_vs_tail_batching": 900,
    "program/sglang_replay_baseline_vs_tail_batching": 900,
    "tiny-moe/logprob_parity": 150,
    "tiny-moe/sglang_engine": 600,
}


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]  # run from the repository root
    budget_s: float
    result: Path | None = None  # the JSON the step writes (a check's result, the import report)
    check: bool = True  # a check starts only if its budget fits; setup runs with what is left


def priority(names: list[str], shape: str, widths: str) -> list[str]:
    """``names`` (the acceptance checks) in the order the call runs them: SGLang on the device (the
    engine check: KV, greedy parity, weight push and parity after it, release/resume, one engine
    start), the program on SGLang, the deterministic race's ledger twice on SGLang, the trainer's MFU
    at 7B widths and on the 0.5B shape; then what no
    GPU has run yet or what changed since its last GPU run; then the rest in their own order."""
    engine = f"{shape}/sglang_engine" if f"{shape}/sglang_engine" in names else "policy/sglang_engine"
    first = [engine, "program/sglang_baseline_vs_tail_batching", "policy/sglang_race_ledger",
             f"{widths}/trainer_throughput",
             f"{shape}/trainer_throughput", "attention/packed_kernels", f"{shape}/sglang_throughput",
             f"{shape}/offload_and_optimizer_state", "policy/sglang_engine"]
    first = [n for n in dict.fromkeys(first) if n in names]
    return first + [n for n in names if n not in first]


def setup_steps(work: Path, bundle: Path | None, wheels: Path | None) -> list[Step]:
    """Unpack the bundle, install the wheels, check that sglang imports from them."""
    py = sys.executable
    steps = []
    if bundle is not None:
        steps.append(Step("setup/unpack", [py, "-m", "bench.tools.sglang_bundle", "unpack", "--parts", str(bundle),
                                           "--dest", str(work / "sglang-site"), "--check-held"],
                          SETUP_BUDGETS_S["setup/unpack"], check=False))
    if wheels is not None:
        steps.append(Step("setup/wheels", [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                           "--no-compile", "--target", str(work / "site"),
                                           *map(str, sorted(wheels.glob("*.whl")))],
                          SETUP_BUDGETS_S["setup/wheels"], check=False))
    if bundle is not None:
        report = work / "sglang_imports.json"
        steps.append(Step("setup/sglang_imports", [py, "-m", "bench.tools.sglang_imports", "--json", str(report)],
                          SETUP_BUDGETS_S["setup/sglang_imports"], report, check=False))
    return steps


def check_steps(device: str, work: Path, out: Path, only: list[str] | None) -> tuple[list[Step], list[str]]:
    """The checks in ``priority`` order, and those ``only`` leaves out. Imports the checks' module:
    on the GPU machine only once the setup has put its requirements on ``sys.path``."""
    import warnings

    import torch

    warnings.simplefilter("ignore")  # megatron's warnings about absent Apex/TE belong to the checks' logs
    from bench.gpu import acceptance

    sizes = acceptance.GPU if device == "cuda" else acceptance.CPU
    budgets = GPU_BUDGETS_S if device == "cuda" else CPU_BUDGETS_S
    names = priority(acceptance.check_names(torch.device(device)), sizes.shape_name, sizes.widths_name)
    unbudgeted = [n for n in names if n not in budgets]
    if unbudgeted:
        raise SystemExit(f"bench.gpu.run: no {device} budget for {unbudgeted}: add them to "
                         f"{'GPU' if device == 'cuda' else 'CPU'}_BUDGETS_S")
    left_out = [n for n in names if only and not acceptance.matches(n, only)]
    steps = []
    for name in (n for n in names if n not in left_out):
        result = work / "results" / (name.replace("/", "__") + ".json")
        steps.append(Step(name, [sys.executable, "-m", "bench.gpu.acceptance", "--device", device, "check", name,
                                 str(work / "checks"), str(result), "--profile", str(out)],
                          budgets[name], result))
    return steps, left_out


def site_paths(work: Path, bundle: Path | None, wheels: Path | None) -> list[str]:
    """The unpacked bundle, then the wheels, then this repository: first on every step's path."""
    return ([str(work / "sglang-site")] if bundle else []) + ([str(work / "site")] if wheels else []) + [str(REPO)]


def child_env(device: str, paths: list[str]) -> dict[str, str]:
    """The steps' environment: ``paths`` first on the path; on a GPU the SGLang engine's environment
    (what the caller set is kept)."""
    from rollpacker.rollout.sglang_args import gpu_engine_env

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + inherited))
    if device == "cuda":
        env.update(gpu_engine_env())
    return env


class Run:
    """The call's record: every step's status, written to OUT after each step."""

    def __init__(self, out: Path, work: Path, budget_s: float, header: dict[str, Any]):
        self.out, self.work, self.budget_s = out, work, budget_s
        self.t0 = time.monotonic()
        self.summary: dict[str, Any] = {"env": header, "budget_s": budget_s, "elapsed_s": 0.0, "steps": {}}
        out.mkdir(parents=True, exist_ok=True)
        (work / "logs").mkdir(parents=True, exist_ok=True)
        (work / "results").mkdir(parents=True, exist_ok=True)
        self.log = open(out / "log.txt", "w")

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def say(self, line: str) -> None:
        print(f"[gpu_run {time.monotonic() - self.t0:6.1f}s] {line}", flush=True)
        self.log.write(f"[{time.monotonic() - self.t0:6.1f}s] {line}\n")
        self.log.flush()

    def record(self, name: str, entry: dict[str, Any]) -> None:
        self.summary["steps"][name] = entry
        self.summary["elapsed_s"] = time.monotonic() - self.t0
        _write_json(self.out / "summary.json", self.summary)
        (self.out / "summary.md").write_text(summary_markdown(self.summary))

    def pending(self, steps: list[Step]) -> None:
        for step in steps:
            self.record(step.name, {"status": "pending", "budget_s": step.budget_s})

    def execute(self, steps: list[Step], env: dict[str, str]) -> None:
        for step in steps:
            left = self.left()
            if step.check and step.budget_s > left:
                self.say(f"{step.name}: not started: needs {step.budget_s:.0f} s, {max(left, 0):.0f} s left")
                self.record(step.name, {"status": "not started", "reason": "budget", "budget_s": step.budget_s,
                                        "left_s": max(left, 0.0)})
                continue
            limit = step.budget_s if step.check else max(min(step.budget_s, left), 1.0)
            self.say(f"{step.name}: started (limit {limit:.0f} s)")
            entry = self._execute(step, env, limit)
            self.say(f"{step.name}: {entry['status']} ({entry['seconds']:.1f} s)"
                     + (f" {entry['error']}" if "error" in entry else ""))
            self.record(step.name, entry)
            self._keep_metrics(step.name)

    def finish(self) -> int:
        """0 when no step failed or timed out (checks left unstarted by the budget do not fail the call)."""
        statuses = [e["status"] for e in self.summary["steps"].values()]
        self.say(f"done: {statuses.count('passed')} passed, {statuses.count('failed')} failed, "
                 f"{statuses.count('timed out')} timed out, {statuses.count('not started')} not started")
        self.log.close()
        return 0 if all(s in ("passed", "not started") for s in statuses) else 1

    def _execute(self, step: Step, env: dict[str, str], limit: float) -> dict[str, Any]:
        if step.result is not None:
            step.result.unlink(missing_ok=True)
        log_path = self.work / "logs" / (step.name.replace("/", "__") + ".log")
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(step.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code: int | None = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                code = None
            end_process_tree(proc)
        entry: dict[str, Any] = {"budget_s": step.budget_s, "limit_s": limit, "seconds": time.monotonic() - t0}
        result = _read_json(step.result)
        if code is None:
            entry["status"] = "timed out"
        elif code != 0:
            entry.update(status="failed", exit=code, error=_last_error(log_path))
        elif step.result is not None and result is None:
            entry.update(status="failed", error=f"exit 0 but no {step.result.name} written")
        else:
            entry["status"] = "passed" if result is None or result.get("ok", True) else "failed"
        if result is not None:
            entry["partial" if result.get("partial") else "result"] = result
        if entry["status"] != "passed":
            self.log.write(f"--- {step.name}: the last lines of its output ---\n{_tail(log_path)}\n")
        return entry

    def _keep_metrics(self, name: str) -> None:
        """A program's per-step metrics (both modes, one file) into OUT, for the record."""
        if not name.startswith("program/"):
            return
        backend = "sglang" if "sglang" in name else "reference"
        lines = []
        for mode in ("baseline", "tail_batching"):
            path = self.work / "checks" / f"program-{backend}" / mode / "metrics.jsonl"
            if path.exists():
                lines += [json.dumps({"mode": mode, **json.loads(line)}) for line in path.read_text().splitlines()]
        if lines:
            (self.out / f"program-{backend}-metrics.jsonl").write_text("\n".join(lines) + "\n")


def end_process_tree(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of a step: its process group, and its descendants that started
    sessions of their own (SGLang engine hosts, torchrun's workers); then wait until they are gone,
    so that the next check finds the device's memory free."""
    pids = _descendants(proc.pid)
    kill_group(proc.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + GONE_WAIT_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                children = [int(c) for c in task.read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _alive(pid: int) -> bool:
    """Running, or stopped: not gone and not a zombie (whose memory is already freed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _read_json(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        return {"ok": False, "error": f"{path.name} is not JSON: {exc}"}
    return data if isinstance(data, dict) else {"value": data}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)  # whole or not at all, should the call be cut off mid-write


def _tail(path: Path) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])


def _last_error(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip() and
             "warn" not in line.lower()]
    return lines[-1][:500] if lines else "no output"


def summary_markdown(summary: dict[str, Any]) -> str:
    from bench.gpu.markdown import details, figures

    env = summary["env"]
    lines = [f"# GPU run: {env['device']}, {env['date']}", "",
             f"`{env['command']}`, commit {env['commit']}, Python {env['python']}; budget "
             f"{summary['budget_s']:.0f} s, {summary['elapsed_s']:.0f} s used.", "",
             "| step | status | seconds (budget) | figures |", "|---|---|---|---|"]
    finished = {}
    for name, e in summary["steps"].items():
        result = e.get("result") or e.get("partial") or {}
        seconds = f"{e['seconds']:.1f} ({e['budget_s']:.0f})" if "seconds" in e else f"({e['budget_s']:.0f})"
        what = e.get("error") or (figures(result) if result else "") or e.get("reason", "")
        lines.append(f"| {name} | {e['status']} | {seconds} | {what} |")
        if result and name.count("/") == 1 and not name.startswith("setup/"):
            finished[name] = result
    return "\n".join(lines + details(finished)) + "\n"


def _header(device: str, argv: list[str]) -> dict[str, Any]:
    """The machine and code under test, read without touching the device (a CUDA context in this
    process would hold device memory for the whole run)."""
    import platform

    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    gpu = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]) \
        if device == "cuda" else ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": gpu or platform.processor() or device, "python": platform.python_version(),
            "commit": run(["git", "rev-parse", "--short", "HEAD"]) or "unknown",
            "command": " ".join(["python -m bench.gpu.run", *argv])}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="bench.gpu.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, help="the SGLang bundle's folder (parts and meta); without it, "
                   "sglang is whatever this interpreter imports")
    p.add_argument("--budget-s", type=float, required=True, help="seconds the whole call may take")
    p.add_argument("--out", type=Path, required=True, help=f"the results: at most {MAX_OUT_FILES} small files")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-run"),
                   help="sites, models, logs and the checks' own files")
    p.add_argument("--wheels", type=Path, help="wheels to install for the checks (default on cuda: .whl/ where "
                   "it exists)")
    p.add_argument("--only", nargs="*", help="run only the checks whose names start with these")
    p.add_argument("--plan", action="store_true", help="print the steps and their budgets, run nothing")
    args = p.parse_args(argv)
    wheels = args.wheels or (REPO / ".whl" if args.device == "cuda" and (REPO / ".whl").is_dir() else None)
    if wheels is not None and not any(wheels.glob("*.whl")):
        p.error(f"--wheels {wheels}: no .whl files there")
    if args.bundle is not None and not args.bundle.is_dir():
        p.error(f"--bundle {args.bundle}: no such folder")
    work, out = args.work.resolve(), args.out.resolve()
    bundle, wheels = args.bundle and args.bundle.resolve(), wheels and wheels.resolve()
    setup = setup_steps(work, bundle, wheels)
    paths = site_paths(work, bundle, wheels)
    if args.plan:
        checks, _ = check_steps(args.device, work, out, args.only)
        for s in setup + checks:
            print(f"{s.budget_s:6.0f} s  {s.name}{'' if s.check else ' (setup: runs with what is left)'}")
        return 0
    run = Run(out, work, args.budget_s, _header(args.device, argv))
    env = child_env(args.device, paths)
    run.pending(setup)
    run.execute(setup, env)
    sys.path[:0] = paths[:-1]  # the checks' module imports what the setup installed
    try:
        checks, left_out = check_steps(args.device, work, out, args.only)
    except Exception as exc:  # every check imports the same module: recorded, and the call ends
        run.say(f"the checks' module does not import: {type(exc).__name__}: {exc}")
        run.record("setup/checks", {"status": "failed", "budget_s": 0, "seconds": 0.0,
                                    "error": f"{type(exc).__name__}: {exc}"})
        return run.finish()
    run.pending(checks)
    for name in left_out:
        run.record(name, {"status": "not started", "reason": "not selected (--only)",
                          "budget_s": (GPU_BUDGETS_S if args.device == "cuda" else CPU_BUDGETS_S)[name]})
    run.execute(checks, env)
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
