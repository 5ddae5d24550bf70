"""The loss's log-prob pass over a 152k vocabulary: entropy from the same pass against a second pass.

    python -m bench.micro.logprob [--tokens 1024] [--vocab 151936] [--repeats 5] [--threads 2]
                                  [--out bench/results/logprob.json]

The trainer needs each response token's log-prob (with gradient) and its entropy (a metric). Both
read the whole ``[tokens, V]`` logits, so on a GPU these memory-bound passes, not the matmuls,
were about 40% of a Qwen2.5-0.5B micro-batch (docs/gpu/2026-11-23-h100-b/profile-after.txt). Two
ways, same logits, same run, alternating order, forward and backward each time:

* one pass - ``token_logprobs(..., with_entropy=True)``: the entropy from the log-prob's forward;
* two passes - ``token_logprobs`` and then ``token_entropy`` under ``no_grad``.

Both give the same numbers (checked). On CPU this measures the traffic saved, not an H100's time:
the GPU acceptance run's profile (``bench.gpu.run``) is the figure that counts there.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.tools.results import REPO, write_results
from megatron_ext.logprobs import token_entropy, token_logprobs
from megatron_ext.parallel import setup_layout


def one_pass(logits, labels, group, vocab):
    logp, entropy = token_logprobs(logits, labels, group, vocab_size=vocab, with_entropy=True)
    logp.sum().backward()
    return logp.detach(), entropy


def two_passes(logits, labels, group, vocab):
    logp = token_logprobs(logits, labels, group, vocab_size=vocab)
    with torch.no_grad():
        entropy = token_entropy(logits, group, vocab_size=vocab)
    logp.sum().backward()
    return logp.detach(), entropy


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936, help="Qwen2.5's (a multiple of 128: no padding columns)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "logprob.json"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    group = setup_layout(seed=0).tp_group
    modes = {"one_pass": one_pass, "two_passes": two_passes}
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(0)
        base = (torch.randn(a.tokens, a.vocab, generator=gen) * 3).to(dtype)
        labels = torch.randint(0, a.vocab, (a.tokens,), generator=gen)
        seconds: dict[str, list[float]] = {m: [] for m in modes}
        outputs = {}
        for r in range(a.repeats + 1):  # the first round warms the allocator and is not counted
            for name in (list(modes) if r % 2 else list(modes)[::-1]):
                logits = base.clone().requires_grad_()
                t = time.perf_counter()
                logp, entropy = modes[name](logits, labels, group, a.vocab)
                if r:
                    seconds[name].append(time.perf_counter() - t)
                outputs[name] = (logp, entropy, logits.grad)
        (lp1, h1, g1), (lp2, h2, g2) = outputs["one_pass"], outputs["two_passes"]
        diff = max((lp1 - lp2).abs().max().item(), (h1 - h2).abs().max().item(), (g1 - g2).float().abs().max().item())
        median = {m: statistics.median(s) for m, s in seconds.items()}
        row = {"dtype": str(dtype).removeprefix("torch."), "seconds": seconds, "median_s": median,
               "two_over_one": median["two_passes"] / median["one_pass"], "max_abs_difference": diff}
        rows.append(row)
        print(f"{row['dtype']}: one pass {median['one_pass']:.3f} s, two passes {median['two_passes']:.3f} s "
              f"(x{row['two_over_one']:.2f}); outputs differ by at most {diff:.2e}", flush=True)
    path = write_results(a.out, {"tokens": a.tokens, "vocab": a.vocab, "threads": a.threads, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
