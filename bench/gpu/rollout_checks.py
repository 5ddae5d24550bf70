"""The rollout half of the GPU acceptance run: the reference engine on the device, weight sync, and the
whole program on one rank (see bench/gpu/acceptance.py)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from bench.gpu.trainer_checks import Subject, trainer_config
from rollpacker.hf_spec import parse_spec
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import Completion, GenerationRequest, RolloutEngine, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine
from testkit import free_base_port
from rollpacker.trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def drain_completions(engine: RolloutEngine) -> dict[str, Completion]:
    """The completions by request id of everything in flight, once all of it has finished."""
    out = {}
    while engine.active_request_ids():
        out.update((c.request_id, c) for c in engine.poll(None))
    return out


def drain(engine: RolloutEngine) -> dict[str, list[int]]:
    """Output tokens by request id of everything in flight, once all of it has finished."""
    return {rid: list(c.output_ids) for rid, c in drain_completions(engine).items()}


def hf_model(model_dir: Path, device: torch.device):
    """transformers' model of ``model_dir`` in fp32 on ``device``: the reference implementation."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            for _ in range(new_tokens):  # no EOS stop: the engine is asked for exactly new_tokens
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            outs.append(ids[0, len(p):].tolist())
    return outs


def check_greedy_parity(subject: Subject, prompts: int = 8, new_tokens: int = 32) -> dict[str, Any]:
    """The reference engine (fp32, continuous batching, paged KV) emits transformers' greedy tokens."""
    vocab = parse_spec(subject.model_dir).vocab_size
    rng = random.Random(7)
    batch = [[rng.randrange(vocab) for _ in range(rng.randint(4, 40))] for _ in range(prompts)]
    engine = ReferenceEngine(subject.model_dir, RolloutConfig(kv_cache_tokens=8192), device=subject.device,
                             dtype=torch.float32)
    engine.submit([GenerationRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_new_tokens=new_tokens))
                   for i, p in enumerate(batch)])
    got = drain(engine)
    engine.shutdown()
    expected = hf_greedy(hf_model(subject.model_dir, subject.device), batch, new_tokens)
    equal = sum(a == b for i, b in enumerate(expected) for a, b in zip(got[f"g{i}"], b))
    first_diff = [next((k for k, (a, b) in enumerate(zip(got[f"g{i}"], e)) if a != b), None)
                  for i, e in enumerate(expected)]
    return {"tokens": prompts * new_tokens, "equal_tokens": equal, "first_divergence": first_diff,
            "ok": equal == prompts * new_tokens}


def check_engine_throughput(subject: Subject, batches: list[int], new_tokens: int,
                            prompt_tokens: int = 64) -> dict[str, Any]:
    """Decode throughput of the reference engine on the device, by batch size (sampling, no EOS)."""
    vocab = parse_spec(subject.model_dir).vocab_size
    dtype = torch.bfloat16 if subject.cuda else torch.float32
    cfg = RolloutConfig(kv_cache_tokens=max(batches) * (prompt_tokens + new_tokens + 16), max_running_requests=max(batches),
                        max_prefill_tokens=16384)
    engine = ReferenceEngine(subject.model_dir, cfg, device=subject.device, dtype=dtype)
    rng = random.Random(8)
    rows = []
    for b in [batches[0], *batches]:  # the first batch twice: its first run warms kernels up
        reqs = [GenerationRequest(f"b{b}r{i}", [rng.randrange(vocab) for _ in range(prompt_tokens)],
                                  SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i)) for i in range(b)]
        t0 = time.perf_counter()
        engine.submit(reqs)
        out = drain(engine)
        seconds = time.perf_counter() - t0
        rows.append({"batch": b, "new_tokens": sum(len(v) for v in out.values()), "seconds": seconds,
                     "tokens_per_s": sum(len(v) for v in out.values()) / seconds})
    engine.shutdown()
    return {"dtype": str(dtype), "prompt_tokens": prompt_tokens, "rows": rows[1:],
            "ok": all(r["new_tokens"] == r["batch"] * new_tokens for r in rows)}


# The engine host's side of a weight push (rollpacker.rollout.sglang_host): unpickle each bucket and take
# it into the host's own memory, then report a bitwise checksum per tensor.
_HOST_SIDE = """
import json, pickle, struct, sys
import torch
from rollpacker.rollout.sglang_host import _own
out = {}
while (head := sys.stdin.buffer.read(8)):
    bucket = _own(pickle.loads(sys.stdin.buffer.read(struct.unpack("<Q", head)[0])))
    out.update((n, int(t.contiguous().view(-1).view(torch.uint8).long().sum())) for n, t in bucket)
print(json.dumps(out))
"""


def check_host_weight_transport(subject: Subject) -> dict[str, Any]:
    """The SGLang backend's weight push to an engine host process (a process it starts itself, not one
    multiprocessing spawned): buckets packed by ``pack_bucket`` (CUDA IPC handles on a GPU, bytes on
    CPU), unpickled and copied by the host's own code; every tensor arrives bit for bit."""
    from rollpacker.rollout.sglang_backend import pack_bucket, weight_buckets

    trainer = Trainer(trainer_config(subject), subject.model_dir, subject.layout)
    tensors = list(trainer.iter_hf_tensors())
    sent = {n: int(t.contiguous().view(-1).view(torch.uint8).long().sum()) for n, t in tensors}
    host = subprocess.Popen([sys.executable, "-c", _HOST_SIDE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=REPO, start_new_session=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    t0 = time.perf_counter()
    buckets = 0
    for bucket in weight_buckets(tensors, RolloutConfig().weight_bucket_mb << 20):
        payload = pack_bucket(bucket)
        host.stdin.write(len(payload).to_bytes(8, "little") + payload)
        host.stdin.flush()
        buckets += 1
    host.stdin.close()
    received = json.loads(host.stdout.read())
    seconds = time.perf_counter() - t0
    host.wait()
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    return {"tensors": len(tensors), "buckets": buckets, "bytes": nbytes, "seconds": seconds,
            "ipc": subject.cuda, "ok": received == sent}


def check_weight_sync(subject: Subject) -> dict[str, Any]:
    """Trainer -> engine weight sync on the device: seconds, bytes, and exact weights afterwards."""
    trainer = Trainer(trainer_config(subject), subject.model_dir, subject.layout)
    dtype = torch.bfloat16 if subject.dtype == "bf16" else torch.float32
    engine = ReferenceEngine(subject.model_dir, RolloutConfig(kv_cache_tokens=1024), device=subject.device, dtype=dtype)
    with torch.no_grad():  # make the sync carry something the engine does not already hold
        for p in trainer.model.parameters():
            p.add_(0.01)
    nbytes = 0

    def counted():
        nonlocal nbytes
        for name, tensor in trainer.iter_hf_tensors():
            nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    engine.update_weights(counted())  # warm-up: allocator and the gather path
    if subject.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    nbytes = 0
    engine.update_weights(counted())
    if subject.cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    diff = engine.max_weight_diff(trainer.iter_hf_tensors())
    engine.shutdown()
    return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9, "max_abs_diff_after": diff,
            "ok": diff == 0.0}


# The sync check of each step, by backend: the reference engine reads its weights back (run.verify_sync,
# exact); sglang cannot, so the trainer's log-probs of the engine's samples must agree with the
# engine's own. fp32 on CPU: the largest per-token gap (train/logprob_mismatch_max) is 2.9e-6 on SGLang,
# 4.5e-6 on the reference engine (tests/integration/test_stale_sync.py prints both), bound at 3e-5; on a
# GPU the engine's bf16 kernels differ from the trainer's token by token, so there the verdict is on the
# mean over tokens (train/logprob_mismatch), and the maximum is recorded.
LOGPROB_MISMATCH_CHECK = {"cpu": ("train/logprob_mismatch_max", 3e-5), "cuda": ("train/logprob_mismatch", 1e-2)}


MISMATCH_FIGURES = ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "ppl_ratio", "tokens_above")


def check_program(device: torch.device, out_dir: Path, steps: int, timeout: int, backend: str = "reference",
                  progress: Callable[[dict[str, Any]], None] | None = None, overrides: Sequence[str] = (),
                  label: str = "program") -> dict[str, Any]:
    """The real program (torchrun, one rank, the shipped policy and example; ``overrides`` on top) on
    rollout ``backend``: the synchronous baseline and tail batching back to back on the same machine,
    the trainer and the engine sharing the device (offload/onload each step); seconds per step, their
    ratio, and each step's weight-sync check. ``progress`` receives the modes run so far after each one."""
    modes = {}
    for mode in ("baseline", "tail_batching"):
        run_dir = out_dir / f"{label}-{backend}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "-m", "rollpacker.train", "--config", "configs/tiny-cpu.yaml", f"scheduler.mode={mode}",
               f"run.steps={steps}", f"run.output_dir={run_dir}", f"run.name={mode}", "run.wandb=disabled",
               f"run.save_every={steps}", "reward.num_workers=2", f"rollout.backend={backend}",
               # the subject is training's seconds per step: no held-out evaluation between steps
               "run.eval.every=0", "run.eval.before_train=false",
               # one rank: every round at rollout TP 1
               "scheduler.planner.long_tp=1", "scheduler.planner.max_tp=1"]
        cmd += ([f"rollout.sglang_base_port={free_base_port(1)}"] if backend == "sglang" else ["run.verify_sync=true"])
        cmd += list(overrides)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "warn" not in line.lower()]
            raise RuntimeError(f"{mode}: exit {proc.returncode}\n" + "\n".join(errors[-60:]))
        metrics = [json.loads(line) for line in (run_dir / mode / "metrics.jsonl").read_text().splitlines()]
        step_s = [m["time/step_s"] for m in metrics]
        mismatch_key, mismatch_bound = LOGPROB_MISMATCH_CHECK[device.type]
        sync = [m["sync/max_abs_diff" if backend == "reference" else mismatch_key] for m in metrics]
        modes[mode] = {"wall_s": wall, "steps": len(metrics), "step_s": step_s, "sum_step_s": sum(step_s),
                       "rounds": [m["round"] for m in metrics], "rollout_tp": [m["rollout_tp"] for m in metrics],
                       "reward_mean": [m["reward_mean"] for m in metrics],
                       "rollout_s": [m["rollout_s"] for m in metrics],
                       "train_s": [m.get("time/train_s") for m in metrics],
                       "sync_check": sync, "sync_bytes": [m["sync/bytes"] for m in metrics],
                       "logprob_mismatch_max": [m["train/logprob_mismatch_max"] for m in metrics],
                       # the engine-trainer gap of every step (rollpacker/trainer/mismatch.py)
                       "mismatch": {k: [m.get(f"mismatch/{k}") for m in metrics] for k in MISMATCH_FIGURES},
                       "sync_ok": all(v == 0.0 for v in sync) if backend == "reference"
                       else all(v < mismatch_bound for v in sync)}
        if progress:
            progress({"device": str(device), "backend": backend, "modes": modes})
    ratio = modes["baseline"]["sum_step_s"] / modes["tail_batching"]["sum_step_s"]
    # step 1 carries each process's one-off costs (CUDA context, kernel loading, allocator growth)
    warm = sum(modes["baseline"]["step_s"][1:]) / max(sum(modes["tail_batching"]["step_s"][1:]), 1e-9)
    print(f"[{label}/{backend}] tail batching over the baseline: {ratio:.2f}x ({warm:.2f}x after step 1)", flush=True)
    return {"device": str(device), "backend": backend, "modes": modes, "speedup_tail_batching_over_baseline": ratio,
            "speedup_after_step_1": warm,
            "ok": all(m["steps"] == steps and m["sync_ok"] for m in modes.values())}


def check_replay_program(device: torch.device, out_dir: Path, run, shape_dir: Path, timeout: int,
                         backend: str = "reference", progress: Callable[[dict[str, Any]], None] | None = None
                         ) -> dict[str, Any]:
    """``check_program`` with paper-shaped lengths: every response as long as the parametric long-tail
    model says (median = limit / 28, stop tokens ignored), ``run.p0`` x ``run.r0`` per step, on the
    random model of the run's shape with the policy's tokenizer (``run.on_shape``) or on the policy."""
    model = REPO / "assets" / "policy"
    if run.on_shape:
        model = out_dir / f"{shape_dir.name}-with-tokenizer"
        model.mkdir(parents=True, exist_ok=True)
        for source in [*shape_dir.iterdir(), *(REPO / "assets" / "policy").glob("tokenizer*.json")]:
            if not (model / source.name).exists():
                (model / source.name).symlink_to(source.resolve())
    overrides = [f"model.path={model}", f"scheduler.p0={run.p0}", f"scheduler.r0={run.r0}",
                 f"rollout.max_response_length={run.limit}", "rollout.length_replay.enabled=true",
                 f"rollout.length_replay.median={run.limit / 28:.1f}",
                 f"rollout.kv_cache_tokens={2 * run.p0 * run.r0 * run.limit}"]
    result = check_program(device, out_dir, run.steps, timeout, backend, progress, overrides, label="replay")
    return {**result, "replay": {"model": model.name, "p0": run.p0, "r0": run.r0, "limit": run.limit,
                                 "median": run.limit / 28}}
