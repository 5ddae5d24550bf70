"""Profile the GPU acceptance run's trainer_throughput workload: the GPU backend on a random model of
Qwen2.5-0.5B's shape (or Qwen2.5-7B's widths with 4 layers), one 8,192-token packed micro-batch of
long-tailed sequences.

    PYTHONPATH=/tmp/site:$PWD python3 bench/gpu/profile_trainer.py WORKDIR [0.5b|7b-widths-4l] [trainer.KEY=VALUE ...]

e.g. ``packed_attention=per_sequence`` or ``fused_swiglu=true``. Prints seconds per forward+backward
and the attention path taken, torch.profiler's tables (by CUDA and by CPU self time) and the
forward-only seconds. docs/gpu/2026-11-23-h100-b/profile-{before,after}.txt are its output (0.5B).
"""
import random, sys, time
from functools import partial
from pathlib import Path
import torch
from bench.gpu.acceptance import QWEN25_05B
from bench.gpu.trainer_checks import (PEAK_BF16_FLOPS, QWEN25_7B_WIDTHS_4L, Subject, make_groups, profile_tables,
                                     trainer_config, training_flops)
from megatron_ext.parallel import setup_layout
from megatron_ext.sdpa_attention import packed_attention_paths
from rollpacker.hf_spec import parse_spec
from rollpacker.sample import Prompt, Sample
from testkit import make_random_qwen2
from rollpacker.trainer.backend import micro_batch_loss
from rollpacker.trainer.packing import build_micro_batch
from rollpacker.trainer.trainer import Trainer

work = Path(sys.argv[1]); work.mkdir(parents=True, exist_ok=True)
shape_name = sys.argv[2] if len(sys.argv) > 2 else "0.5b"
shape = {"0.5b": QWEN25_05B, "7b-widths-4l": QWEN25_7B_WIDTHS_4L}[shape_name]
changes = {k.removeprefix("trainer."): {"true": True, "false": False}.get(v, v)
           for k, v in (a.split("=", 1) for a in sys.argv[3:])}
d = work / ("m" if shape_name == "0.5b" else shape_name)
if not (d / "config.json").exists():
    make_random_qwen2(d, seed=11, **shape)
layout = setup_layout(seed=1234)
subject = Subject("m", d, torch.device("cuda"), layout, "bf16", 2e-5)
spec = parse_spec(d)
rng = random.Random(5)
trainer = Trainer(trainer_config(subject, micro_batch_tokens=8192, **changes), d, layout)
backend = trainer.backend
samples, used = [], 0
while used < 8192:
    n = min(int(rng.paretovariate(1.2) * 128), 4096, 8192 - used)
    if n < 8: break
    p = Prompt(uid=len(samples), input_ids=[rng.randrange(spec.vocab_size) for _ in range(n // 4)], data_source="s")
    samples.append(Sample(prompt=p, response_index=0, reward=1.0, advantage=1.0,
                          response_ids=[rng.randrange(spec.vocab_size) for _ in range(n - n // 4)]))
    used += n
mb = build_micro_batch(samples, aggregation="token_mean", layout=backend.micro_batch_layout, pad_multiple=backend.pad_multiple)
loss_fn = partial(micro_batch_loss, cfg=trainer.cfg, tp_group=trainer.layout.tp_group, vocab_size=backend.vocab_size)
trainer.train_step(make_groups(d, 6))
backend.zero_grad()
for _ in range(2): backend.forward_backward([mb], loss_fn)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): backend.forward_backward([mb], loss_fn)
torch.cuda.synchronize(); seconds = (time.perf_counter() - t) / 5
flops = training_flops(d, [len(s.prompt.input_ids) + len(s.response_ids) for s in samples])
print("s per micro-batch", seconds, "seqs", len(samples), "MFU", flops / seconds / PEAK_BF16_FLOPS, flush=True)
print("shape", shape_name, "config changes", changes, "attention paths", packed_attention_paths(backend.model), flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(2): backend.forward_backward([mb], loss_fn)
    torch.cuda.synchronize()
print(profile_tables(prof, cuda=True))
# forward only timing split
torch.cuda.synchronize(); t = time.perf_counter()
with torch.no_grad():
    for _ in range(3): backend.forward_backward([mb], loss_fn, forward_only=True)
torch.cuda.synchronize(); print("forward-only s", (time.perf_counter() - t) / 3)
