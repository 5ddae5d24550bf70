"""Engine-host checks of our ``SGLangEngine`` against the real ``sglang.Engine`` (0.5.23) on CPU.

    python -m torch.distributed.run --standalone --nproc_per_node 2 host_checks.py MODEL_DIR BASE_PORT

As ``EngineSets`` builds them, rank 0 leads a TP-1 engine and the TP-2 engine of ranks {0, 1};
rank 1 leads its own TP-1 engine. Rank 0 then checks:
- L2: each engine runs in a host process of its own (sglang keeps one live config per process),
  and after a weight push to each, both generate what transformers does with the pushed weights;
- L9: shutting the TP-2 engine down ends its host and sglang's processes under it, and leaves the
  rank's other children (a stand-in for the reward workers) and the TP-1 engine running;
- L8: a SIGTERM to the rank and to its engine host reaches our handler, and the engine keeps serving
  (sglang's own SIGTERM watchdog would exit the process);
- a dead sglang scheduler makes ``poll(None)`` raise ``EngineDiedError`` instead of waiting forever.
The last stdout line of rank 0 is ``VERDICT {json}`` (each check true, or what went wrong).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine_checks import backend_generate, compare, hf_greedy, perturbed, prompt_ids

DEATH_TIMEOUT_S = 60  # the host's watch notices a dead sglang process within about a second


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


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


def rank0_checks(model_dir: Path, tp1, tp2) -> dict:
    from transformers import Qwen2ForCausalLM

    from rollpacker.rollout.engine import GenerationRequest, SamplingParams
    from rollpacker.rollout.sglang_backend import EngineDiedError

    verdict: dict = {}
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompt_ids(model_dir)
    pids = {"rank": os.getpid(), "tp1_host": tp1.host_pid, "tp2_host": tp2.host_pid}
    verdict["one_engine_per_process"] = (
        True if len(set(pids.values())) == 3 else f"engines share a process: {pids}")

    new_weights = perturbed(hf)
    hf.load_state_dict(dict(new_weights), strict=False)
    want = hf_greedy(hf, prompts)
    for name, eng in (("tp1", tp1), ("tp2", tp2)):
        eng.update_weights(iter(new_weights))
        verdict[f"{name}_greedy_after_push_matches_transformers"] = compare(
            f"{name} after push", backend_generate(eng, f"{name}-a", prompts), want)

    # L9: the rank's other children survive an engine's shutdown.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    tp2_tree = {tp2.host_pid} | descendants(tp2.host_pid)
    tp2.shutdown()
    time.sleep(0.5)
    left = sorted(p for p in tp2_tree if alive(p))
    verdict["shutdown_ends_the_engines_processes"] = True if not left else f"still alive after shutdown: {left}"
    verdict["shutdown_spares_the_ranks_other_children"] = (
        True if bystander.poll() is None else f"the rank's child exited with {bystander.returncode}")
    bystander.kill()
    bystander.wait()

    # L8: SIGTERM to the rank (our handler) and to its engine host (as Slurm signals a whole step).
    got = []
    previous = signal.signal(signal.SIGTERM, lambda *_: got.append(time.monotonic()))
    os.kill(tp1.host_pid, signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1.0)
    signal.signal(signal.SIGTERM, previous)
    verdict["sigterm_reaches_our_handler"] = True if got else "our SIGTERM handler never ran"
    verdict["engine_serves_after_sigterm"] = compare(
        "tp1 after SIGTERM", backend_generate(tp1, "tp1-b", prompts), want)

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


def main(model_dir: Path, base_port: int) -> dict | None:
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.sglang_backend import SGLangEngine

    dist.init_process_group("gloo", timeout=timedelta(minutes=20))
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    cfg = RolloutConfig(backend="sglang", sglang_base_port=base_port, kv_cache_tokens=32768)
    tp1 = SGLangEngine(model_dir, cfg, engine_id=rank, device="cpu")
    tp2 = SGLangEngine(model_dir, cfg, group=pair, engine_id=0, device="cpu")
    verdict = None
    try:
        if rank == 0:
            verdict = rank0_checks(model_dir, tp1, tp2)
    finally:
        dist.barrier()
        for eng in (tp2, tp1):
            eng.shutdown()
        dist.destroy_process_group()
    return verdict


if __name__ == "__main__":
    started = time.monotonic()
    try:
        result = main(Path(sys.argv[1]), int(sys.argv[2]))
    except Exception:  # noqa: BLE001 - the pytest side reports it
        result = {"crashed": traceback.format_exc()}
    if result is not None:
        result["seconds"] = round(time.monotonic() - started, 1)
        print("VERDICT " + json.dumps(result), flush=True)
