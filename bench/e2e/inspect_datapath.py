"""Dump what the GRPO trainer actually trains on, for a few steps of the built-in example.

    torchrun --nproc_per_node 2 -m bench.e2e.inspect_datapath --dump DIR -- --config configs/tiny-cpu.yaml \
        run.name=inspect run.steps=3 ...
    python -m bench.e2e.inspect_datapath --check DIR

The first form runs ``rollpacker.train`` unchanged, with two read-only taps (wrappers, no change to
what is computed):

* every prompt group the stream trainer turns into advantages (``with_advantages``): per sample the
  prompt ids, response ids, engine log-probs, reward, correctness, reason and advantage;
* every micro-batch the trainer builds (``build_micro_batch``): per sequence the tokens under
  ``loss_mask`` (what the loss is taken on) and the advantage there.

Each rank writes ``DIR/rank<R>.jsonl``. The second form reads them and checks, for every trained
sample: the ground truth recomputed from the prompt's own text; the reward recomputed by the
example's own scorer (``rollpacker.examples.task.score_response``)
on the decoded response equals the reward the pool gave; the group advantages equal
``(r - mean) / (std + eps)`` from those rewards; the loss mask covers exactly the response tokens
(the closing ``<|im_end|>`` included, the prompt excluded); and it prints a few decoded examples.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path


def _install_taps(out: Path) -> None:
    import rollpacker.trainer.packing as packing
    import rollpacker.trainer.stream as stream

    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    sink = open(out / f"rank{rank}.jsonl", "a", buffering=1)
    counter = {"call": 0}

    real_adv = stream.with_advantages

    def with_advantages(group, cfg):
        res = real_adv(group, cfg)
        counter["call"] += 1
        for s in res:
            sink.write(json.dumps({
                "kind": "sample", "call": counter["call"], "uid": s.prompt.uid, "epoch": s.prompt.epoch,
                "ground_truth": s.prompt.ground_truth, "extra_info": s.prompt.extra_info,
                "prompt_ids": list(s.prompt.input_ids), "response_ids": list(s.response_ids),
                "rollout_logprobs": list(s.rollout_logprobs), "finish_reason": s.finish_reason,
                "reward": s.reward, "correct": s.correct, "reason": s.reward_reason,
                "advantage": s.advantage, "group_size": len(res),
            }) + "\n")
        return res

    stream.with_advantages = with_advantages

    real_build = packing.build_micro_batch

    def build_micro_batch(samples, **kw):
        mb = real_build(samples, **kw)
        if mb.layout == "padded":
            for row, s in enumerate(samples):
                mask = mb.loss_mask[row] > 0
                sink.write(json.dumps({
                    "kind": "mb", "uid": s.prompt.uid, "response_index": s.response_index,
                    "masked_labels": mb.labels[row][mask].tolist(),
                    "adv": sorted(set(mb.advantages[row][mask].tolist())),
                    "response_ids": list(s.response_ids),
                }) + "\n")
        else:  # thd: one packed row, sequences at cu_seqlens
            cu = mb.cu_seqlens.tolist()
            for i, s in enumerate(samples):
                lo, hi = cu[i], cu[i + 1]
                mask = mb.loss_mask[0, lo:hi] > 0
                sink.write(json.dumps({
                    "kind": "mb", "uid": s.prompt.uid, "response_index": s.response_index,
                    "masked_labels": mb.labels[0, lo:hi][mask].tolist(),
                    "adv": sorted(set(mb.advantages[0, lo:hi][mask].tolist())),
                    "response_ids": list(s.response_ids),
                }) + "\n")
        return mb

    packing.build_micro_batch = build_micro_batch
    # plan_micro_batches calls build_micro_batch through the packing module's globals: patched above


def check(dump: Path, tokenizer_dir: str, show: int = 6, eps: float = 1e-6) -> int:
    import math

    from tokenizers import Tokenizer

    from rollpacker.examples.task import Problem, score_response

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    samples, mbs = [], []  # every rank's records (a group trained in finish() appears on each rank)
    for f in sorted(dump.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            r["_rank"] = f.stem
            (samples if r["kind"] == "sample" else mbs).append(r)
    problems = defaultdict(list)
    groups = defaultdict(list)
    for s in samples:
        groups[(s["uid"], s["epoch"], s["call"], s.get("_rank", 0))].append(s)
        text = tok.decode(s["response_ids"], skip_special_tokens=True)
        ok, reason = score_response(text, s["ground_truth"])
        if float(ok) != s["reward"] or reason != s["reason"]:
            problems["reward_mismatch"].append((s["uid"], text, s["ground_truth"], s["reward"], s["reason"], ok, reason))
        # the ground truth belongs to this prompt: recompute it from the prompt's own text
        prompt_text = tok.decode(s["prompt_ids"], skip_special_tokens=True)
        m = re.search(r"Start at (\d+), apply (\S+) (\d+) times", prompt_text)
        if m is None or str(Problem(int(m.group(1)), m.group(2), int(m.group(3))).answer()) != str(s["ground_truth"]):
            problems["ground_truth_not_this_prompt"].append((s["uid"], prompt_text[-60:], s["ground_truth"]))
        if s["finish_reason"] == "stop" and (not s["response_ids"] or s["response_ids"][-1] != 0):
            problems["stop_without_eos"].append((s["uid"], s["response_ids"][-3:]))
        if len(s["rollout_logprobs"]) != len(s["response_ids"]):
            problems["logprob_len"].append((s["uid"], len(s["rollout_logprobs"]), len(s["response_ids"])))
    for key, g in groups.items():
        rewards = [x["reward"] for x in g]
        n = len(rewards)
        mean = sum(rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
        for x in g:
            want = 0.0 if n == 1 else (x["reward"] - mean) / (std + eps)
            if abs(want - x["advantage"]) > 1e-6:
                problems["advantage"].append((key, rewards, x["advantage"], want))
    for m in mbs:
        if m["masked_labels"] != m["response_ids"]:
            problems["mask"].append((m["uid"], m["masked_labels"][:8], m["response_ids"][:8]))
        if len(m["adv"]) != 1:
            problems["mb_adv"].append((m["uid"], m["adv"]))
    # finish() hands every rank the same remaining groups (each trains its share): count each group once
    unique = {}
    for (uid, epoch, _call, _rank), g in groups.items():
        unique.setdefault((uid, epoch), g)
    zero_var = sum(1 for g in unique.values() if len({x["reward"] for x in g}) == 1)
    print(f"{sum(len(g) for g in unique.values())} samples in {len(unique)} distinct prompt groups "
          f"({zero_var} with one reward for all: no signal); {len(mbs)} micro-batch rows checked")
    reasons = defaultdict(int)
    for g in unique.values():
        for s in g:
            reasons[s["reason"]] += 1
    print("reward reasons:", dict(reasons))
    sizes = defaultdict(int)
    for g in unique.values():
        sizes[len(g)] += 1
    print("group sizes:", dict(sizes))
    for s in samples[:show]:
        print("---", "prompt:", repr(tok.decode(s["prompt_ids"], skip_special_tokens=False)[-70:]))
        print("    response:", repr(tok.decode(s["response_ids"], skip_special_tokens=False)))
        print(f"    gt {s['ground_truth']} reward {s['reward']} ({s['reason']}) advantage {s['advantage']:+.3f} "
              f"finish {s['finish_reason']}")
    for k, v in problems.items():
        print(f"PROBLEM {k}: {len(v)}; first: {v[:3]}")
    if not problems:
        print("no problems: ground truths match the prompts, rewards recomputed from the decoded text match, "
              "advantages match, the loss mask covers exactly the response tokens")
    return 1 if problems else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dump", help="run rollpacker.train with the taps, writing here")
    p.add_argument("--check", help="check a dump directory")
    p.add_argument("--tokenizer", default="assets/policy")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args()
    if args.check:
        return check(Path(args.check), args.tokenizer)
    _install_taps(Path(args.dump))
    from rollpacker.train import main as train_main

    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return train_main(rest)


if __name__ == "__main__":
    sys.exit(main())
