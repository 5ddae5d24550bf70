"""Generate with a checkpoint in a rollout engine: JSONL prompts in, JSONL completions out.

    rollpacker-generate --model HF_DIR --input prompts.jsonl --output out.jsonl \\
        [--backend reference|sglang] [--tp N] [--temperature T (0 = greedy)] [--max-new-tokens N] [--n K]

For ``--tp N > 1`` run it under ``torchrun --nproc_per_node N``: the N ranks form one
engine (rank 0 leads and writes the output). Each input line carries ``"prompt"``
(text, tokenized with the model directory's tokenizer) or ``"input_ids"``. Each output
line is one completion — ``index`` (input line, 0-based), ``sample`` (0..K-1),
``output_ids``, per-token ``logprobs`` (temperature-1 model log-probs), ``finish_reason``
and, for text prompts, ``text`` — in input order. Generation stops at the model's EOS
(from ``generation_config.json`` / ``config.json``) unless ``--ignore-eos``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rollpacker.cli_help import HelpFormatter
from rollpacker.rollout import make_engine
from rollpacker.rollout.config import RolloutConfig
from rollpacker.rollout.engine import Completion, GenerationRequest, RequestError, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollpacker-generate", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--input", required=True, help="JSONL with 'prompt' (text) or 'input_ids' per line")
    p.add_argument("--output", required=True, help="JSONL to write, one completion per line")
    p.add_argument("--backend", choices=("reference", "sglang"), default="reference")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (run under torchrun when > 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--seed", type=int, default=0, help="completion k of line i uses seed + i * n + k")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    p.add_argument("--kv-cache-tokens", type=int, default=RolloutConfig.kv_cache_tokens)
    p.add_argument("--device", default="cpu", help="cpu or cuda (sglang: cpu runs its plain-torch CPU path)")
    p.add_argument("--sglang-base-port", type=int, default=RolloutConfig.sglang_base_port,
                   help="sglang: first port of this node's engines (see RolloutConfig.sglang_base_port)")
    args = p.parse_args(argv)
    if args.n < 1 or args.max_new_tokens < 1 or args.tp < 1:
        p.error("--n, --max-new-tokens and --tp must be >= 1")
    return args


def read_prompts(path: Path, model_dir: Path) -> tuple[list[list[int]], Any]:
    """Token ids per input line, and the tokenizer if any line was text (else None)."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{number}: not valid JSON: {exc}") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("input_ids" in row):
            raise SystemExit(f"{path}:{number}: each line needs exactly one of 'prompt' (text) or 'input_ids'")
        rows.append(row)
    tokenizer = None
    if any("prompt" in r for r in rows):
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: text prompts need a tokenizer in {model_dir}: {exc}") from None
    return [tokenizer(r["prompt"])["input_ids"] if "prompt" in r else list(r["input_ids"]) for r in rows], tokenizer


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()


def request_id(line: int, sample: int) -> str:
    return f"line{line + 1}/sample{sample}"


def generate(engine, prompts: list[list[int]], params: list[SamplingParams], n: int) -> dict[str, Completion]:
    from tqdm import tqdm

    engine.submit([GenerationRequest(request_id(i, k), p, params[i * n + k])
                   for i, p in enumerate(prompts) for k in range(n)])
    done: dict[str, Completion] = {}
    with tqdm(total=len(prompts) * n, unit="completion", desc="generate", disable=None) as bar:
        while engine.active_request_ids():
            finished = engine.poll(None)
            done.update((c.request_id, c) for c in finished)
            bar.update(len(finished))
    return done


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch  # after parsing: --help answers without it
    import torch.distributed as dist

    model_dir = Path(args.model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp} needs exactly {args.tp} ranks (torchrun --nproc_per_node {args.tp}); "
                         f"this run has {world}")
    device = args.device
    if device == "cuda" and args.backend == "reference":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)  # NCCL collectives of the TP group run on this rank's GPU
    group = None
    if world > 1:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        group = dist.new_group(list(range(world)))
    cfg = RolloutConfig(backend=args.backend, tp=args.tp, kv_cache_tokens=args.kv_cache_tokens, seed=args.seed,
                        sglang_base_port=args.sglang_base_port)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"rollpacker-generate: starting the {args.backend} engine (tp={args.tp}) on {model_dir}", file=sys.stderr,
              flush=True)
    engine = make_engine(cfg, model_dir, group=group, device=device)
    if not engine.is_leader:
        engine.serve_follower()  # until the leader's stop_followers()
        engine.shutdown()
        dist.destroy_process_group()
        return
    prompts, tokenizer = read_prompts(Path(args.input), model_dir)
    stops = () if args.ignore_eos else eos_token_ids(model_dir)
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                             seed=args.seed + i * args.n + k)
              for i in range(len(prompts)) for k in range(args.n)]
    start = time.perf_counter()
    try:
        done = generate(engine, prompts, params, args.n)
    except RequestError as exc:
        engine.stop_followers()
        engine.shutdown()
        raise SystemExit(f"{args.input}: {exc}") from None
    seconds = time.perf_counter() - start
    with open(args.output, "w") as out:
        for i in range(len(prompts)):
            for k in range(args.n):
                c = done[request_id(i, k)]
                ids = list(c.output_ids)  # packed arrays when the engine is in another process
                row = {"index": i, "sample": k, "output_ids": ids, "logprobs": list(c.logprobs),
                       "finish_reason": c.finish_reason}
                if tokenizer is not None:
                    row["text"] = tokenizer.decode(ids)
                out.write(json.dumps(row) + "\n")
    tokens = sum(len(c.output_ids) for c in done.values())
    print(f"{len(done)} completions, {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s "
          f"({args.backend}, tp={args.tp}, preemptions={engine.stats().preemptions})")
    engine.stop_followers()
    engine.shutdown()
    if group is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
