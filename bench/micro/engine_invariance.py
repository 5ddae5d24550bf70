"""Does a response depend on what shares its batch? The reference engine, the same seeded requests
served in different company, token by token.

    python -m bench.micro.engine_invariance [--prompts 32] [--n 8] [--out bench/results/engine_invariance.json]

Every request carries its own seed, so its sampling draws are fixed; what can still change a token
is the logits' last bits, which depend on the decode batch (attention over the widest row's keys,
matmuls with as many rows as the batch) and on recomputation after a preemption. The shipped
policy and the example's prompts at temperature 1, ``--n`` responses each, are served:

* ``together``: all at once, as a short round launches them (the reference);
* ``shuffled``: the same requests submitted in another order, in waves of 7;
* ``alone``: each request on its own (batch of one);
* ``tight``: all at once with a KV budget that forces preemptions.

For each it counts the responses whose tokens differ from ``together`` and the first position of
each difference; the log-probs' largest difference over the tokens that agree. A deterministic race
(a prompt's finish decided by its responses' lengths, not the clock) can be exact only where no
token differs; this measures how often one does.
"""
from __future__ import annotations

import argparse
import random

import torch

from bench.tools.results import write_results
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.rollout.reference import ReferenceEngine
from testkit import REPO_ROOT

POLICY = REPO_ROOT / "assets" / "policy"


def serve(requests: list[GenerationRequest], waves: list[list[int]], **cfg) -> tuple[dict, int]:
    """Submit ``waves`` of request indices one after another (each once the engine has room for it is
    not waited for: a wave is submitted when the previous one has been polled once); return the
    completions by request id and the engine's preemptions."""
    engine = ReferenceEngine(POLICY, RolloutConfig(**{"kv_page_size": 16, **cfg}))
    out = {}
    for wave in waves:
        engine.submit([requests[i] for i in wave])
        out.update((c.request_id, c) for c in engine.poll(0.0))
    while engine.active_request_ids():
        out.update((c.request_id, c) for c in engine.poll(None))
    return out, engine.stats().preemptions


def compare(ref: dict, got: dict) -> dict:
    differ, first, worst_lp = [], [], 0.0
    for rid, c in ref.items():
        g = got[rid]
        if g.output_ids != c.output_ids:
            differ.append(rid)
            first.append(next((i for i, (a, b) in enumerate(zip(c.output_ids, g.output_ids)) if a != b),
                              min(len(c.output_ids), len(g.output_ids))))
        else:
            worst_lp = max(worst_lp, max((abs(a - b) for a, b in zip(c.logprobs, g.logprobs)), default=0.0))
    return {"responses": len(ref), "tokens": sum(len(c.output_ids) for c in ref.values()),
            "responses_differing": len(differ), "first_difference_at": sorted(first),
            "logprob_max_abs_diff_where_equal": worst_lp}


def markdown(r: dict) -> str:
    """The results file as docs/results.md's table (rendered by ``python -m bench.tools.report``)."""
    s = r["settings"]
    lines = [f"Shipped policy, {s['prompts']} of the example's prompts x {s['n']} responses at temperature 1, "
             f"{s['threads']} thread(s); `{r['command']}` at {r['commit']}, {r['date'][:10]}, {r['machine']}:", "",
             "| served | responses differing from all-at-once | tokens compared | preemptions | "
             "log-prob max \\|diff\\| where equal |", "|---|---|---|---|---|"]
    for name, c in r["cases"].items():
        lines.append(f"| {name} | {c['responses_differing']} of {c['responses']} | {c['tokens']} | {c['preemptions']} | "
                     f"{c['logprob_max_abs_diff_where_equal']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench/results/engine_invariance.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from rollpacker.data.dataset import PromptDataset
    tokenizer = AutoTokenizer.from_pretrained(POLICY)
    data = PromptDataset([str(REPO_ROOT / "assets" / "data" / "train.jsonl")], tokenizer, max_prompt_length=128,
                         shuffle=False)
    # the program's rollout requests: temperature 1, the tokenizer's EOS as the one stop token (runtime/run.py)
    requests = [GenerationRequest(f"p{i}r{j}", x.input_ids, SamplingParams(
        temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1000 * i + j,
        stop_token_ids=(tokenizer.eos_token_id,))) for i, x in enumerate(data.take(args.prompts)) for j in range(args.n)]
    everything = list(range(len(requests)))
    ref, _ = serve(requests, [everything])
    order = everything[:]
    random.Random(0).shuffle(order)
    cases = {
        "shuffled": serve(requests, [order[k:k + 7] for k in range(0, len(order), 7)]),
        "alone": ({rid: c for i in everything for rid, c in serve(requests, [[i]])[0].items()}, 0),
        "tight": serve(requests, [everything], kv_cache_tokens=4096),
    }
    rows = {}
    for name, (got, preemptions) in cases.items():
        rows[name] = {**compare(ref, got), "preemptions": preemptions}
        r = rows[name]
        print(f"{name}: {r['responses_differing']} of {r['responses']} responses differ ({r['tokens']} tokens), "
              f"first differences at {r['first_difference_at'][:10]}, preemptions {preemptions}, log-prob max "
              f"|diff| where equal {r['logprob_max_abs_diff_where_equal']:.2e}", flush=True)
    write_results(args.out, {"settings": vars(args), "cases": rows})
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
