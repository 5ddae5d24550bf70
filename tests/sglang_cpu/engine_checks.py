"""Checks against the real ``sglang.Engine`` (0.5.23) on CPU, run by ``host_checks.py`` in the venv.

``Reference`` is the transformers side, computed once per run: greedy output of the policy and of
the policy with perturbed weights. ``check_engine`` drives ``sglang.Engine`` directly;
``check_backend`` drives it through our ``SGLangEngine``. Both compare greedy output with
transformers token for token, before and after a weight update that perturbs the policy.
Each check is either true or a string that says what went wrong, so the pytest side can show it.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from lifecycle_checks import lifecycle_checks

PROMPTS = ("The capital of France is", "1 + 1 =", "Once upon a time, in a small village,")
NEW_TOKENS = 12
# The tiny fp32 policy served on CPU: torch-native attention and sampling (no CUDA kernels), no CUDA
# graphs, a small fixed KV pool, and no warm-up request.
CPU_ENGINE_ARGS = dict(device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                       mem_fraction_static=0.05, disable_cuda_graph=True, max_total_tokens=32768,
                       dtype="float32", skip_server_warmup=True)

Weights = list[tuple[str, torch.Tensor]]


@dataclass
class Reference:
    """What transformers generates greedily from ``prompts`` with the shipped weights (``want_before``)
    and with ``new_weights`` pushed (``want_after``); ``old_weights`` undo that push."""
    prompts: list[list[int]]
    new_weights: Weights
    old_weights: Weights
    want_before: list[list[int]]
    want_after: list[list[int]]

    def verdict(self) -> dict:
        return {"perturbation_changes_output": True if self.want_after != self.want_before
                else "the perturbed weights give the same greedy output: the update checks would prove nothing"}


def reference(model_dir: Path) -> Reference:
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    hf = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want_before = hf_greedy(hf, prompts)
    new_weights = perturbed(hf)
    state = hf.state_dict()
    old_weights = [(name, state[name].clone()) for name, _ in new_weights]
    hf.load_state_dict(dict(new_weights), strict=False)
    return Reference(prompts, new_weights, old_weights, want_before, hf_greedy(hf, prompts))


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


def perturbed(model) -> Weights:
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


@contextlib.contextmanager
def without_agent_store() -> Iterator[None]:
    """Hide torchrun's ``TORCHELASTIC_USE_AGENT_STORE`` from the schedulers ``sglang.Engine`` spawns:
    with it they wait for a TCPStore nobody serves (our backend's ``host_env`` strips it)."""
    from rollpacker.rollout.sglang_api import AGENT_STORE_ENV

    saved = os.environ.pop(AGENT_STORE_ENV, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[AGENT_STORE_ENV] = saved


def engine_greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, return_logprob=True,
                           sampling_params=dict(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return [[int(t) for _, t, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]


def check_engine(model_dir: Path, ref: Reference) -> dict:
    """``sglang.Engine`` in this process. Its shutdown kills every child of the process, so it must
    run before this process starts anything else."""
    import sglang
    from sglang.srt.utils.common import cpu_has_amx_support

    # The sgl_kernel stub must keep sglang on its plain-torch layers (what transformers computes).
    verdict: dict = {"plain_torch_layers": True if not cpu_has_amx_support()
                     else "cpu_has_amx_support() is True: sglang would call sgl_kernel CPU ops"}
    with without_agent_store():
        engine = sglang.Engine(model_path=str(model_dir), **CPU_ENGINE_ARGS)
        try:
            verdict["greedy_matches_transformers"] = compare(
                "before update", engine_greedy(engine, ref.prompts), ref.want_before)
            # Outside a session sglang 0.5.23 refuses the update and says so.
            ok, msg = engine.update_weights_from_tensor(named_tensors=ref.new_weights, flush_cache=True)
            verdict["update_outside_session_refused"] = (
                True if ok is False and "begin_weight_update" in msg else f"returned {(ok, msg)!r}")
            results = [engine.begin_weight_update(),
                       engine.update_weights_from_tensor(named_tensors=ref.new_weights, flush_cache=True),
                       engine.end_weight_update()]
            verdict["update_in_session_succeeds"] = (
                True if all(r[0] for r in results) else f"begin/update/end returned {results!r}")
            verdict["greedy_after_update_matches_transformers"] = compare(
                "after update", engine_greedy(engine, ref.prompts), ref.want_after)
        finally:
            engine.shutdown()
    return verdict


STALL_DUMP_ENV = "ROLLPACKER_STALL_DUMP_DIR"  # read by shims/rollpacker_stall_dump.py in the engine host
STALLS: dict[str, str] = {}  # generation tag -> the engine host's state when it timed out


def stall_report(eng, timeout_s: float = 30.0) -> str:
    """The engine host's own account of where its requests wait (``shims/rollpacker_stall_dump.py``)."""
    folder = os.environ.get(STALL_DUMP_ENV)
    if not folder:
        return f"no dump: {STALL_DUMP_ENV} is not set"
    path = Path(folder) / f"host-{eng.host_pid}.txt"
    path.unlink(missing_ok=True)
    os.kill(eng.host_pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:  # the handler runs between the host's calls
        time.sleep(0.1)
    return path.read_text() if path.exists() else f"the engine host wrote no dump within {timeout_s}s"


def backend_generate(eng, tag: str, prompts, max_new_tokens: int = NEW_TOKENS, timeout_s: float = 120):
    """Greedy outputs of ``prompts`` (``[]`` for one that did not finish within ``timeout_s``; the host's
    state is then kept in ``STALLS[tag]``)."""
    from rollpacker.rollout.engine import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    ours = [f"{tag}-{i}" for i in range(len(prompts))]
    eng.submit([GenerationRequest(rid, ids, params) for rid, ids in zip(ours, prompts)])
    done, deadline = {}, time.monotonic() + timeout_s
    while len(done) < len(prompts) and time.monotonic() < deadline:  # an earlier check's late results do not count
        done.update((c.request_id, list(c.output_ids)) for c in eng.poll(timeout=1.0) if c.request_id in ours)
    if len(done) < len(prompts):
        STALLS[tag] = stall_report(eng)
    return [done.get(rid, []) for rid in ours]


def check_backend(eng, ref: Reference, verdict: dict) -> None:
    """Our ``SGLangEngine`` (shipped weights, nothing run yet): greedy, weight update, a refusal, and
    the lifecycle checks; ``eng`` ends up serving ``ref.new_weights``."""
    verdict["backend_greedy_matches_transformers"] = compare(
        "before update", backend_generate(eng, "a", ref.prompts), ref.want_before)
    try:
        eng.update_weights(iter(ref.new_weights))
        verdict["backend_update_weights_returns"] = True
    except Exception as exc:  # noqa: BLE001 - reported, not swallowed
        verdict["backend_update_weights_returns"] = f"raised {exc!r}"
    verdict["backend_greedy_after_update_matches_transformers"] = compare(
        "after update", backend_generate(eng, "b", ref.prompts), ref.want_after)
    verdict["backend_raises_when_sglang_refuses"] = refusal_surfaces(eng, ref.new_weights)
    verdict.update(lifecycle_checks(eng, ref.prompts, ref.want_after))
    verdict["backend_length_replay_is_exact"] = replay_is_exact(eng, ref.prompts)


def replay_is_exact(eng, prompts) -> bool | str:
    """Length replay over the real engine: each response exactly its replayed length, although the
    requests carry stop tokens that sampling at temperature 1 meets (sglang told to ignore EOS)."""
    from rollpacker.rollout.config import ReplayConfig
    from rollpacker.rollout.engine import GenerationRequest, SamplingParams
    from rollpacker.rollout.replay import LengthReplay, ReplayLengths

    lengths = ReplayLengths(ReplayConfig(enabled=True, median=6, seed=3), limit=24)
    replayed = LengthReplay(eng, lengths)
    stops = tuple(range(0, 200, 3))  # a third of the small ids: without replay most responses end early
    requests = [GenerationRequest(f"p{i}e0r{r}", ids, SamplingParams(max_new_tokens=24, stop_token_ids=stops, seed=r))
                for i, ids in enumerate(prompts) for r in range(2)]
    replayed.submit(requests)
    done, deadline = {}, time.monotonic() + 120
    while len(done) < len(requests) and time.monotonic() < deadline:
        done.update((c.request_id, len(c.output_ids)) for c in replayed.poll(timeout=1.0))
    want = {r.request_id: lengths(r) for r in requests}
    return True if done == want else f"lengths {done}, replayed {want}"


def refusal_surfaces(eng, new_weights: Weights) -> bool | str:
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
