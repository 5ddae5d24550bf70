"""The GPU acceptance run: everything a CUDA training run depends on, checked in one call.

On the GPU machine (one GPU, no package index; bring the wheels made by bench/gpu/wheels.sh)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 -m bench.gpu.acceptance --device cuda --out OUT

Anywhere, as a dry run of the same code on tiny shapes (the test suite runs it, with ``--skip`` for
the checks another test already runs: tests/integration/test_gpu_acceptance.py says which)::

    python -m bench.gpu.acceptance --device cpu --out OUT [--jobs 2]

Subjects: the shipped policy, a random model of Qwen2.5-0.5B's shape (a tiny random model on
CPU), and a random Qwen3-MoE at 30B-A3B's widths with 2 layers (a tiny one on CPU) for the MoE
checks: log-prob parity, the SGLang engine with the routing it reports, and (on a GPU) trainer
throughput. Checks, each recorded with its figures and verdict even when another fails:

* trainer (Megatron GPU backend: DDP + distributed optimizer + Megatron's schedule, packed THD):
  log-prob parity with transformers, one GRPO step's gradients against the CPU fp32 backend, the
  loss falling over a few steps, offload/onload moving the bytes they claim, optimizer state
  save/load continuing exactly; tokens/s and MFU on the 0.5B shape;
* rollout: the reference engine's greedy parity on the device, its tokens/s at batch 1-256 on the
  0.5B shape, trainer -> engine weight-sync seconds, and the SGLang backend's weight push into an
  engine host process (CUDA IPC) arriving bit for bit;
* SGLang (``bench/gpu/sglang_checks.py``), through our backend and server arguments: the KV pool
  against the memory plan, greedy parity with transformers, a weight push from the trainer and
  parity after it, release/resume with the bytes freed, and decode tokens/s at batch 1-256 beside
  the reference engine in the same process;
* the program end to end on one rank (the shipped policy and example), on the reference engine and
  on SGLang (trainer and engine sharing the device): baseline and tail batching back to back,
  seconds per step, their ratio, and each step's weight-sync check; then the same on the 0.5B
  shape with paper-shaped replayed lengths (P0=32, R0=8, a 1,024-token limit).

The SGLang checks need sglang importable by this interpreter: on the GPU machine the 0.5.17 bundle
(``python -m bench.tools.sglang_bundle``), on CPU the test suite's venv (``tests/sglang_cpu/env.py``,
``SGLANG_USE_CPU_ENGINE=1``); without it they fail and say so.

Writes ``OUT/acceptance.json`` (every figure) and ``OUT/acceptance.md`` (the summary), rewritten
after each check so that a run cut short keeps what it measured. A lent GPU window's one call runs
these checks through ``bench/gpu/run.py`` instead: in priority order, each within a time budget.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import queue
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from bench.gpu import attention_checks as attention
from bench.gpu import race_checks as race
from bench.gpu import rollout_checks as rollout
from bench.gpu import sglang_checks as sglang
from bench.gpu import trainer_checks as trainer
from bench.gpu.markdown import details, figures
from bench.gpu.trainer_checks import Subject, write_json
from rollpacker.rollout.sglang_args import cpu_shares

REPO = Path(__file__).resolve().parents[2]

# Qwen2.5-0.5B's published config.json shape (random weights: nothing is downloaded).
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
# Qwen3-30B-A3B's widths (hidden 2048, 32 heads of 128, 4 KV heads, experts of 768, top-8) with 2 layers
# of 64 experts: 0.6e9 parameters, random, written as fp32 safetensors (~2.5 GB) once per GPU call.
QWEN3_MOE_WIDTHS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                        num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, mlp_only_layers=[],
                        max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False)
TINY = dict(vocab_size=250, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
# the dry run's: every layer sparse, as sglang serves only such Qwen3-MoE checkpoints
TINY_MOE = dict(TINY, tie_word_embeddings=False, moe_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                mlp_only_layers=[])


@dataclass(frozen=True)
class Sizes:
    """How much each check does: the GPU run's sizes, or the CPU dry run's."""
    shape: dict
    shape_name: str
    shape_lr: float
    loss_steps: int
    throughput_tokens: int
    throughput_micro_batches: int
    engine_batches: tuple[int, ...]
    engine_new_tokens: int
    program_steps: int
    program_timeout_s: int
    widths: dict  # the MFU check's model: Qwen2.5-7B's widths with 4 layers on a GPU
    widths_name: str
    # The per-subject checks on the 0.5B shape too; the dry run's random model is as tiny as the policy,
    # so repeating them there proves nothing more (and costs the suite minutes).
    per_subject_on_shape: bool
    replay: ReplayRun  # the program with paper-shaped replayed lengths
    moe: dict  # the MoE checks' random Qwen3-MoE
    moe_name: str


@dataclass(frozen=True)
class ReplayRun:
    """The program on replayed lengths (``rollpacker.rollout.replay``: the parametric long-tail model with
    median = limit / 28): P0 prompts x R0 responses per step, ``steps`` steps per mode. ``on_shape``: the
    random model of the run's shape with the policy's tokenizer (the dry run's tiny shape has fewer
    token ids than the tokenizer: the policy itself)."""
    p0: int
    r0: int
    limit: int
    steps: int
    on_shape: bool


GPU = Sizes(QWEN25_05B, "qwen2.5-0.5b-shape", 2e-5, 6, 8192, 5, (1, 8, 32, 64, 128, 256), 128, 10, 480,
            trainer.QWEN25_7B_WIDTHS_4L, "qwen2.5-7b-widths-4l", True, ReplayRun(32, 8, 1024, 5, True),
            QWEN3_MOE_WIDTHS, "qwen3-moe-widths-2l")
CPU = Sizes(TINY, "tiny-random", 1e-3, 4, 1024, 1, (1, 4), 8, 2, 400, TINY, "tiny-widths", False,
            ReplayRun(4, 2, 64, 2, False), TINY_MOE, "tiny-moe")
# The trainer's MFU goals on an H100 (issue: one-call packed attention, fused pointwise work); recorded
# beside the figure, not part of the verdict, which says whether the trainer runs correctly.
MFU_GOALS = {"qwen2.5-0.5b-shape": 0.20, "qwen2.5-7b-widths-4l": 0.35}


class Report:
    def __init__(self, out: Path, device: torch.device):
        self.out, self.results = out, {"env": _environment(device), "checks": {}}
        out.mkdir(parents=True, exist_ok=True)

    def record(self, name: str, result: dict[str, Any]) -> None:
        self.results["checks"][name] = result
        print(f"[acceptance] {name}: {'ok' if result['ok'] else 'FAIL'} ({result['seconds']:.1f}s)"
              + (f" {result['error']}" if "error" in result else ""), flush=True)
        self.write()

    def skip(self, name: str) -> None:
        self.results.setdefault("skipped", []).append(name)
        print(f"[acceptance] {name}: skipped (--skip)", flush=True)
        self.write()

    def write(self) -> None:
        write_json(self.out / "acceptance.json", self.results)
        (self.out / "acceptance.md").write_text(markdown(self.results))

    @property
    def passed(self) -> bool:
        return all(c["ok"] for c in self.results["checks"].values())


def measured(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``'s result with its seconds; a check that raises is recorded as failed, and the run goes
    on: one GPU call must report every check."""
    t0 = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["seconds"] = time.perf_counter() - t0
    return result


def _environment(device: torch.device) -> dict[str, Any]:
    import megatron.core
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "megatron_core": megatron.core.__version__,
           "transformer_engine": _has("transformer_engine"), "commit": _commit()}
    if device.type == "cuda":
        env["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(results: dict[str, Any]) -> str:
    env = results["env"]
    lines = [f"# GPU acceptance run: {env['device']}, {env['date']}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}), megatron-core {env['megatron_core']}, Python "
             f"{env['python']}, Transformer Engine {'present' if env['transformer_engine'] else 'absent'}, "
             f"commit {env['commit']}.", "", "| check | verdict | figures |", "|---|---|---|"]
    for name, r in results["checks"].items():
        lines.append(f"| {name} | {'ok' if r['ok'] else '**FAIL**'} | {figures(r)} ({r['seconds']:.1f} s) |")
    lines += [f"| {name} | skipped (--skip) | |" for name in results.get("skipped", [])]
    return "\n".join(lines + details(results["checks"])) + "\n"


def check_table(device: torch.device, work: Path, progress: Callable[[dict[str, Any]], None] | None = None,
                profile_dir: Path | None = None) -> dict[str, Callable[[], dict[str, Any]]]:
    """Every check by name, bound to its subject (built lazily: only the chosen one runs). ``progress``
    receives a check's result so far after each of its stages (the SGLang engine check and the
    programs); ``profile_dir`` gets a torch profile of each trainer throughput check."""
    from megatron_ext.parallel import setup_layout

    sizes = GPU if device.type == "cuda" else CPU
    layout = setup_layout(seed=1234)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    subjects = [Subject("policy", REPO / "assets" / "policy", device, layout, dtype, lr=2e-4),
                Subject(sizes.shape_name, work / sizes.shape_name, device, layout, dtype, lr=sizes.shape_lr)]
    checks: dict[str, Callable[[], dict[str, Any]]] = {}
    for s in subjects:
        checks.update({f"{s.name}/logprob_parity": lambda s=s: trainer.check_logprob_parity(s),
                       f"{s.name}/gradient_parity": lambda s=s: trainer.check_gradient_parity(s, work),
                       f"{s.name}/loss_falls": lambda s=s: trainer.check_loss_falls(s, sizes.loss_steps),
                       f"{s.name}/offload_and_optimizer_state": lambda s=s: trainer.check_offload_and_state(s),
                       f"{s.name}/engine_greedy_parity": lambda s=s: rollout.check_greedy_parity(s),
                       f"{s.name}/sglang_engine": lambda s=s: sglang.check_engine(s, progress=progress)})
    big = subjects[1]

    def profile(name: str) -> Path | None:
        return profile_dir / f"profile-{name}.txt" if profile_dir else None

    def moe_subject() -> Subject:
        """The MoE checks' model (``Sizes.moe``), written on first use."""
        from testkit import make_random_qwen3_moe

        model_dir = work / sizes.moe_name
        if not model_dir.exists():
            make_random_qwen3_moe(work / f"{sizes.moe_name}.partial", seed=13, **sizes.moe).rename(model_dir)
        return Subject(sizes.moe_name, model_dir, device, layout, dtype, lr=sizes.shape_lr)

    checks.update({
        f"{big.name}/trainer_throughput": lambda: _with_goal(big.name, trainer.check_throughput(
            big, sizes.throughput_tokens, sizes.throughput_micro_batches, profile=profile(big.name))),
        f"{sizes.widths_name}/trainer_throughput": lambda: _with_goal(
            sizes.widths_name, trainer.check_throughput_7b_widths(
                work, device, layout, tokens_per_micro_batch=sizes.throughput_tokens,
                micro_batches=sizes.throughput_micro_batches, shape=sizes.widths, name=sizes.widths_name,
                profile=profile(sizes.widths_name))),
        "attention/packed_kernels": lambda: attention.check_packed_kernels(device),
        "policy/sglang_race_ledger": lambda: race.check_race_ledger(subjects[0]),
        f"{sizes.moe_name}/logprob_parity": lambda: trainer.check_logprob_parity(moe_subject()),
        f"{sizes.moe_name}/sglang_engine": lambda: sglang.check_engine(moe_subject(), progress=progress),
        f"{sizes.moe_name}/trainer_throughput": lambda: trainer.check_throughput(
            moe_subject(), sizes.throughput_tokens, sizes.throughput_micro_batches, profile=profile(sizes.moe_name)),
        f"{big.name}/engine_throughput": lambda: rollout.check_engine_throughput(
            big, list(sizes.engine_batches), sizes.engine_new_tokens),
        f"{big.name}/weight_sync": lambda: rollout.check_weight_sync(big),
        f"{big.name}/host_weight_transport": lambda: rollout.check_host_weight_transport(big),
        f"{big.name}/sglang_throughput": lambda: sglang.check_throughput(
            big, list(sizes.engine_batches), sizes.engine_new_tokens),
        "program/baseline_vs_tail_batching": lambda: rollout.check_program(
            device, work, sizes.program_steps, sizes.program_timeout_s, progress=progress),
        "program/sglang_baseline_vs_tail_batching": lambda: rollout.check_program(
            device, work, sizes.program_steps, sizes.program_timeout_s, backend="sglang", progress=progress),
        "program/replay_baseline_vs_tail_batching": lambda: rollout.check_replay_program(
            device, work, sizes.replay, big.model_dir, sizes.program_timeout_s, progress=progress),
        "program/sglang_replay_baseline_vs_tail_batching": lambda: rollout.check_replay_program(
            device, work, sizes.replay, big.model_dir, sizes.program_timeout_s, backend="sglang",
            progress=progress)})
    return checks


def check_names(device: torch.device) -> list[str]:
    sizes = GPU if device.type == "cuda" else CPU
    per_subject = ["logprob_parity", "gradient_parity", "loss_falls", "offload_and_optimizer_state",
                   "engine_greedy_parity", "sglang_engine"]
    per_subject_names = ("policy", sizes.shape_name) if sizes.per_subject_on_shape else ("policy",)
    return ([f"{name}/{c}" for name in per_subject_names for c in per_subject]
            + [f"{sizes.shape_name}/{c}" for c in ("trainer_throughput", "engine_throughput", "weight_sync",
                                                   "host_weight_transport", "sglang_throughput")]
            + [f"{sizes.widths_name}/trainer_throughput"]
            # the one-call kernels have no CPU backward (tests/unit/test_packed_attention.py covers the rest)
            + (["attention/packed_kernels"] if device.type == "cuda" else [])
            # sglang reads the seed only with deterministic inference, a GPU mode (on CPU:
            # tests/integration/test_sglang_real.py's race check, with replayed lengths)
            + (["policy/sglang_race_ledger"] if device.type == "cuda" else [])
            # MoE, after the dense checks: the device's run at 30B-A3B's widths, the dry run's on a tiny
            # model (its throughput measures nothing there)
            + [f"{sizes.moe_name}/{c}" for c in ("logprob_parity", "sglang_engine", "trainer_throughput")
               if device.type == "cuda" or c != "trainer_throughput"]
            + ["program/baseline_vs_tail_batching", "program/sglang_baseline_vs_tail_batching",
               "program/replay_baseline_vs_tail_batching", "program/sglang_replay_baseline_vs_tail_batching"])


def _with_goal(name: str, result: dict[str, Any]) -> dict[str, Any]:
    goal = MFU_GOALS.get(name)
    if goal is not None and result.get("mfu") is not None:
        result.update(mfu_goal=goal, mfu_goal_met=result["mfu"] >= goal)
    return result


def make_shape_model(device: torch.device, work: Path) -> None:
    """The random model of the run's shape (``Sizes.shape``) in ``work``, written once: the checks of
    that subject read it. Written aside and renamed, so that a check killed while writing it
    (bench/gpu/run.py) leaves none that the next check would take for whole."""
    import shutil

    from testkit import make_random_qwen2

    sizes = GPU if device.type == "cuda" else CPU
    model_dir = work / sizes.shape_name
    if model_dir.exists():
        return
    aside = work / f"{sizes.shape_name}.partial"
    shutil.rmtree(aside, ignore_errors=True)
    make_random_qwen2(aside, seed=11, **sizes.shape)
    aside.rename(model_dir)


def run_one(device: torch.device, work: Path, name: str, result_file: Path, profile_dir: Path | None = None) -> None:
    """Entry of a check's own process: run it and write its result. The result so far is written
    after each stage of a check that has stages, marked ``partial`` and not ok: a check killed at a
    time limit (bench/gpu/run.py) keeps what it measured."""
    def progress(partial: dict[str, Any]) -> None:
        write_json(result_file, {**partial, "ok": False, "partial": True})

    make_shape_model(device, work)
    result = check_table(device, work, progress, profile_dir)[name]()
    write_json(result_file, result)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.gpu.acceptance", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    ref = sub.add_parser("grad-reference", help="(internal) the CPU fp32 backend's gradients for one step")
    ref.add_argument("model_dir", type=Path)
    ref.add_argument("out", type=Path)
    ref.add_argument("--seed", type=int, default=2)
    one = sub.add_parser("check", help="(internal) run one check in this process")
    one.add_argument("name")
    one.add_argument("work", type=Path)
    one.add_argument("result", type=Path)
    one.add_argument("--cpus", help="run on these CPUs only (a job's share of the machine under --jobs)")
    one.add_argument("--profile", type=Path, help="write the trainer throughput checks' torch profiles here")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_acceptance")
    p.add_argument("--only", nargs="*", help="run only the checks whose names start with these")
    p.add_argument("--skip", nargs="*", help="leave out the checks whose names start with these (each is "
                   "reported as skipped: the CPU suite leaves out what another test already runs)")
    p.add_argument("--jobs", type=int, default=1, help="checks run at once, each still in a process of its "
                   "own (CPU only: on a GPU they would share its memory)")
    args = p.parse_args(argv)
    if args.command == "grad-reference":
        trainer.cpu_reference_gradients(args.model_dir, args.out, args.seed)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu for the dry run")
    if args.jobs < 1 or (args.device == "cuda" and args.jobs != 1):
        p.error(f"--jobs {args.jobs}: must be 1 on cuda (each check assumes the device to itself), >= 1 on cpu")
    if args.command == "check":
        if args.cpus:
            _confine(sorted(int(c) for c in args.cpus.split(",")))
        run_one(torch.device(args.device), args.work, args.name, args.result, args.profile)
        return 0
    return run(torch.device(args.device), args.out, only=args.only, skip=args.skip, jobs=args.jobs)


def matches(name: str, prefixes: list[str] | None) -> bool:
    return any(name.startswith(o) or name.split("/")[-1].startswith(o) for o in prefixes or [])


def run(device: torch.device, out: Path, only: list[str] | None = None, skip: list[str] | None = None,
        jobs: int = 1) -> int:
    """Each check in a process of its own: a failed or leaky check cannot starve the next one of
    device memory (Megatron's DDP and optimizer keep trainers alive past ``del`` and ``gc``). With
    ``jobs`` > 1 (CPU), that many at once, each on its own share of the CPUs (``_cpu_shares``);
    results are still recorded in the checks' order."""
    report = Report(out, device)
    work = out / "work"
    make_shape_model(device, work)
    chosen = []
    for name in check_names(device):
        if only and not matches(name, only):
            continue
        if matches(name, skip):
            report.skip(name)
            continue
        chosen.append(name)
    shares: queue.Queue[list[int] | None] = queue.Queue()
    for share in _cpu_shares(jobs):
        shares.put(share)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        running = {name: pool.submit(measured, functools.partial(_in_subprocess, device, work, name, shares))
                   for name in chosen}
        for name in chosen:
            report.record(name, running[name].result())
    print(f"[acceptance] {'PASS' if report.passed else 'FAIL'}: {out / 'acceptance.md'}", flush=True)
    return 0 if report.passed else 1


def _cpu_shares(jobs: int) -> list[list[int] | None]:
    """One share of this process's CPUs per job (None: the whole machine, for a single job). Jobs
    that share CPUs run far slower than their halves would: sglang's CPU engine binds its threads to
    every CPU of the node, and another job's threads then preempt them mid-step (the SGLang engine
    check took 159 s beside the others against 35 s alone)."""
    return [None] if jobs == 1 else cpu_shares(jobs)


def _confine(cpus: list[int]) -> None:
    """This check, and every process it starts, on ``cpus`` only (sglang's engines included:
    ``sglang_args.cpu_engine_env`` binds them to the process's CPUs)."""
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def _in_subprocess(device: torch.device, work: Path, name: str, shares: queue.Queue) -> dict[str, Any]:
    result_file = work / (name.replace("/", "__") + ".json")
    result_file.unlink(missing_ok=True)
    share = shares.get()
    cpus = ["--cpus", ",".join(map(str, share))] if share else []
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.gpu.acceptance", "--device", device.type, "check", name,
                               str(work), str(result_file), *cpus], cwd=REPO, capture_output=True, text=True)
    finally:
        shares.put(share)
    if proc.returncode != 0 or not result_file.exists():
        errors = [line for line in proc.stderr.splitlines() if "warn" not in line.lower()]
        last = next((line for line in reversed(errors) if line.strip()), f"exit {proc.returncode}")
        return {"ok": False, "error": last, "traceback": "\n".join(errors[-80:])}
    return json.loads(result_file.read_text())


if __name__ == "__main__":
    sys.exit(main())
