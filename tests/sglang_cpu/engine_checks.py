"""Checks against the real ``sglang.Engine`` (0.5.23) on CPU; run with the venv's python (``env.py``).

    python engine_checks.py engine MODEL_DIR
    python -m torch.distributed.run --standalone --nproc_per_node 1 engine_checks.py backend MODEL_DIR

``engine`` drives ``sglang.Engine`` directly; ``backend`` drives it through our ``SGLangEngine``. Both
compare greedy output with transformers token for token, before and after a weight update that
perturbs the policy. ``backend`` runs as a torchrun worker, as ``launch/train.sh`` starts the trainer,
and also checks the engine's lifecycle (``lifecycle_checks.py``).
The last stdout line is ``VERDICT {json}``: each check is either true or a string that says what went
wrong, so the pytest side can show it.

An engine spawns its scheduler processes, so everything runs under ``if __name__ == "__main__"``,
and each mode starts one engine in its own process (sglang keeps one live config per process).
"""
from __future__ import annotations

import json
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from lifecycle_checks import lifecycle_checks, start_under_torchrun

PROMPTS = ("The capital of France is", "1 + 1 =", "Once upon a time, in a small village,")
NEW_TOKENS = 12
# The tiny fp32 policy served on CPU: torch-native attention and sampling (no CUDA kernels), no CUDA
# graphs, a small fixed KV pool, and no warm-up request.
CPU_ENGINE_ARGS = dict(device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                       mem_fraction_static=0.05, disable_cuda_graph=True, max_total_tokens=32768,
                       dtype="float32", skip_server_warmup=True)


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the TP-1 engine of local rank 0 uses p and nccl_port = p + 1)
    that the config accepts as ``sglang_base_port``, so that concurrent test runs on one machine do
    not collide on the configured default."""
    from rollpacker.configlib import ConfigError
    from rollpacker.rollout.config import RolloutConfig

    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                RolloutConfig(backend="sglang", sglang_base_port=port).validate()
            except ConfigError:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free pair of consecutive ports")


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p)["input_ids"] for p in PROMPTS]


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy reference: argmax of the full-sequence forward, no EOS stop (as ``ignore_eos``)."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
            outs.append(seq[len(ids):])
    return outs


def perturbed(model) -> list[tuple[str, torch.Tensor]]:
    """New weights far enough from the policy to change its greedy output (seeded)."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for name, p in model.state_dict().items():
        if name.endswith(("mlp.down_proj.weight", "lm_head.weight")):
            out.append((name, (p + torch.randn(p.shape, generator=gen) * p.std()).contiguous()))
    return out


def compare(label: str, got: list[list[int]], want: list[list[int]]) -> bool | str:
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if not bad:
        return True
    i = bad[0]
    return f"{label}: prompt {i} got {got[i]}, transformers {want[i]} ({len(bad)}/{len(want)} differ)"


def engine_greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, return_logprob=True,
                           sampling_params=dict(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return [[int(t) for _, t, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def check_engine(model_dir: Path, new_weights, prompts, want_before, want_after) -> dict:
    import sglang
    from sglang.srt.utils.common import cpu_has_amx_support

    # The sgl_kernel stub must keep sglang on its plain-torch layers (what transformers computes).
    verdict: dict = {"plain_torch_layers": True if not cpu_has_amx_support()
                     else "cpu_has_amx_support() is True: sglang would call sgl_kernel CPU ops"}
    engine = sglang.Engine(model_path=str(model_dir), **CPU_ENGINE_ARGS)
    try:
        verdict["greedy_matches_transformers"] = compare("before update", engine_greedy(engine, prompts),
                                                         want_before)
        # Review item C1: outside a session sglang 0.5.23 refuses the update and says so.
        ok, msg = engine.update_weights_from_tensor(named_tensors=new_weights, flush_cache=True)
        verdict["update_outside_session_refused"] = (
            True if ok is False and "begin_weight_update" in msg else f"returned {(ok, msg)!r}")
        results = [engine.begin_weight_update(),
                   engine.update_weights_from_tensor(named_tensors=new_weights, flush_cache=True),
                   engine.end_weight_update()]
        verdict["update_in_session_succeeds"] = (
            True if all(r[0] for r in results) else f"begin/update/end returned {results!r}")
        verdict["greedy_after_update_matches_transformers"] = compare(
            "after update", engine_greedy(engine, prompts), want_after)
    finally:
        engine.shutdown()
    return verdict


def backend_engine(model_dir: Path):
    """Our backend on CPU with the arguments it builds itself (``sglang_args.server_args``); its KV
    budget is the raw engine's, so both checks run the same pool."""
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.sglang_backend import SGLangEngine

    cfg = RolloutConfig(backend="sglang", sglang_base_port=free_port_pair(),
                        kv_cache_tokens=CPU_ENGINE_ARGS["max_total_tokens"])
    return SGLangEngine(model_dir, cfg, device="cpu")


def backend_generate(eng, tag: str, prompts, max_new_tokens: int = NEW_TOKENS, timeout_s: float = 120):
    from rollpacker.rollout.engine import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    eng.submit([GenerationRequest(f"{tag}-{i}", ids, params) for i, ids in enumerate(prompts)])
    done, deadline = {}, time.monotonic() + timeout_s
    while len(done) < len(prompts) and time.monotonic() < deadline:
        done.update((c.request_id, c.output_ids) for c in eng.poll(timeout=1.0))
    return [done.get(f"{tag}-{i}", []) for i in range(len(prompts))]


def check_backend(model_dir: Path, new_weights, prompts, want_before, want_after) -> dict:
    verdict: dict = {}
    eng = start_under_torchrun(model_dir, verdict)
    try:
        verdict["backend_greedy_matches_transformers"] = compare("before update",
                                                                 backend_generate(eng, "a", prompts), want_before)
        try:
            eng.update_weights(iter(new_weights))
            verdict["backend_update_weights_returns"] = True
        except Exception as exc:  # noqa: BLE001 - reported, not swallowed
            verdict["backend_update_weights_returns"] = f"raised {exc!r}"
        verdict["backend_greedy_after_update_matches_transformers"] = compare(
            "after update", backend_generate(eng, "b", prompts), want_after)
        verdict["backend_raises_when_sglang_refuses"] = refusal_surfaces(eng, new_weights)
        # Last: on a backend that releases a busy engine, sglang's scheduler asserts and the
        # engine (with this process) dies, so the verdict line is lost; checks_run says how far it got.
        verdict.update(lifecycle_checks(eng, prompts, want_after))
    finally:
        eng.shutdown()
    return verdict


def refusal_surfaces(eng, new_weights) -> bool | str:
    """A real refusal reaches the caller: with a session already open (here, opened behind the
    backend's back), sglang answers begin_weight_update with (False, "...already open")."""
    eng._host.call("begin_weights")
    try:
        eng.update_weights(iter(new_weights))
        return "update_weights returned although sglang refused to open the session"
    except Exception as exc:  # noqa: BLE001 - judged below
        text = str(exc)
        return True if "engine 0" in text and "already open" in text else f"raised {exc!r}"
    finally:
        eng._host.call("close_weights")


def main(mode: str, model_dir: Path) -> dict:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompt_ids(model_dir)
    want_before = hf_greedy(hf, prompts)
    new_weights = perturbed(hf)
    hf.load_state_dict(dict(new_weights), strict=False)
    want_after = hf_greedy(hf, prompts)
    verdict = {"perturbation_changes_output": True if want_after != want_before
               else "the perturbed weights give the same greedy output: the update check would prove nothing"}
    check = {"engine": check_engine, "backend": check_backend}[mode]
    verdict.update(check(model_dir, new_weights, prompts, want_before, want_after))
    return verdict


if __name__ == "__main__":
    started = time.monotonic()
    try:
        result = main(sys.argv[1], Path(sys.argv[2]))
    except Exception:  # noqa: BLE001 - the pytest side reports it
        result = {"crashed": traceback.format_exc()}
    result["seconds"] = round(time.monotonic() - started, 1)
    print("VERDICT " + json.dumps(result), flush=True)
