"""Reference engine vs transformers static-batch ``generate``: tokens/s, same model, prompts, machine, run.

    python -m bench.micro.engine [--model HF_DIR | random] [--threads 1] [--out bench/results/engine.json]

Two workloads, greedy on both sides:
- uniform: BATCH requests, every one generating exactly ``--uniform-len`` tokens (one static batch);
- long-tailed: ``--tail-batches`` x BATCH requests. With ``assets/policy`` (or ``--model``) the
  prompts are the task's (``--data``, chat template applied as in training) and the lengths
  come from the model itself (EOS, capped at ``--tail-cap``); with the random fallback model,
  EOS is disabled on both sides and each request's ``max_new_tokens`` is drawn from a
  log-normal tail. transformers runs static batches of BATCH that each wait for
  their longest member; the engine keeps up to BATCH requests running, refilling freed slots.
Only tokens each request actually needed count. Each side runs ``--repeats`` times,
interleaved, and the best is kept (the machine is shared). Every repeat's rate goes to
``--out``, from which ``python -m bench.tools.report`` renders the table in docs/results.md (also printed).
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.tools import report
from bench.tools.results import REPO, write_results
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine
from testkit import REPO_ROOT, make_random_qwen2

RANDOM_MODEL = dict(vocab_size=1024, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_new: list[int]  # per request
    eos: int | None  # stop id on both sides, or None (lengths forced by max_new)
    goal: float  # engine / transformers tokens/s the issue asks for


def _hf_tokens_per_s(model, w: Workload, batch: int) -> float:
    tokens, start = 0, time.perf_counter()
    for lo in range(0, len(w.prompts), batch):
        prompts, caps = w.prompts[lo:lo + batch], w.max_new[lo:lo + batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(caps),
                             eos_token_id=w.eos, pad_token_id=0)[:, width:].tolist()
        for row, cap in zip(out, caps):  # count what each request needed, as the engine does
            row = row[:cap]
            tokens += row.index(w.eos) + 1 if w.eos is not None and w.eos in row else len(row)
    return tokens / (time.perf_counter() - start)


def _engine_tokens_per_s(model_dir: Path, w: Workload, batch: int) -> tuple[float, list[int]]:
    longest = max(len(p) + n for p, n in zip(w.prompts, w.max_new))
    cfg = RolloutConfig(max_running_requests=batch, kv_cache_tokens=batch * longest)
    engine = ReferenceEngine(model_dir, cfg)
    stops = () if w.eos is None else (w.eos,)
    start = time.perf_counter()
    engine.submit([GenerationRequest(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=n,
                                                               stop_token_ids=stops))
                   for i, (p, n) in enumerate(zip(w.prompts, w.max_new))])
    lengths = []
    while engine.active_request_ids():
        lengths += [len(c.output_ids) for c in engine.poll(None)]
    return engine.stats().tokens_generated / (time.perf_counter() - start), lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="HF Qwen2 dir, or 'random' (default: assets/policy if present, else random)")
    p.add_argument("--data", default=str(REPO_ROOT / "assets" / "data" / "train.jsonl"),
                   help="task prompts for the long-tailed run with a policy")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--uniform-len", type=int, default=64)
    p.add_argument("--tail-batches", type=int, default=4)
    p.add_argument("--tail-cap", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "engine.json"), help="raw results (JSON)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    policy = Path(args.model) if args.model else REPO_ROOT / "assets" / "policy"
    if args.model not in (None, "random") and not (policy / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there")
    tmp = None
    if args.model != "random" and (policy / "config.json").is_file():
        model_dir, source = policy, f"{args.model or 'assets/policy'} (tail lengths from the model's EOS)"
        eos = json.loads((policy / "config.json").read_text()).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
    else:
        tmp = tempfile.TemporaryDirectory()
        model_dir = make_random_qwen2(tmp.name, **RANDOM_MODEL)
        source, eos = f"random Qwen2 {RANDOM_MODEL} (EOS disabled, log-normal max_new_tokens)", None
    from transformers import Qwen2ForCausalLM
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size

    def random_prompts(n: int) -> list[list[int]]:
        lengths = torch.randint(16, 49, (n,), generator=g).tolist()
        return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]

    n_tail = args.batch * args.tail_batches
    if eos is None:  # median ~ cap/16, a few reach the cap: the published long-tail shape
        tail = torch.exp(torch.randn(n_tail, generator=g) * 1.1 + math.log(args.tail_cap / 16))
        tail = Workload("long-tailed", random_prompts(n_tail), tail.clamp(4, args.tail_cap).long().tolist(), None,
                        goal=2.0)
    else:
        from transformers import AutoTokenizer
        from rollpacker.data.dataset import PromptDataset
        data = PromptDataset([args.data], AutoTokenizer.from_pretrained(model_dir), max_prompt_length=512,
                             shuffle=False)
        tail = Workload("long-tailed", [x.input_ids for x in data.take(n_tail)], [args.tail_cap] * n_tail, eos,
                        goal=2.0)
    workloads = [Workload("uniform", random_prompts(args.batch), [args.uniform_len] * args.batch, None, goal=1.0),
                 tail]
    print(f"model: {source}\nthreads={args.threads} batch={args.batch} repeats={args.repeats} (best kept)", flush=True)
    rows = []
    for w in workloads:
        trials = []
        with torch.inference_mode():
            for _ in range(args.repeats):
                hf_rate = _hf_tokens_per_s(hf, w, args.batch)
                engine_rate, lengths = _engine_tokens_per_s(model_dir, w, args.batch)
                trials.append({"transformers_tok_s": hf_rate, "engine_tok_s": engine_rate})
        lengths.sort()
        best = {k: max(t[k] for t in trials) for k in trials[0]}
        rows.append({"workload": w.name, "requests": len(w.prompts), "goal": w.goal, "trials": trials, "best": best,
                     "ratio": best["engine_tok_s"] / best["transformers_tok_s"],
                     "output_length": {"median": lengths[len(lengths) // 2], "p90": lengths[len(lengths) * 9 // 10],
                                       "max": lengths[-1]}})
    results = write_results(args.out, {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                                       "model": source, "workloads": rows})
    print(report.engine(json.loads(results.read_text())))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
