"""The real ``sglang.Engine`` (0.5.23) on CPU, against transformers and against our backend.

The engine runs in a cached venv built by ``sglang_cpu.env`` (first build: about 1.5 minutes). It is
never skipped: if the venv cannot be built, the test fails with pip's reason.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.bounds import CPU_SYNC_BOUND
from testkit import free_base_port, kill_group, run_in_session
from tests.sglang_cpu.env import REPO, engine_env

CHECKS = Path(__file__).resolve().parents[1] / "sglang_cpu" / "host_checks.py"
POLICY = REPO / "assets" / "policy"
CHECKS_TIMEOUT_S = 720
TIMEOUT_S = 300


def run_in_venv(cmd: list[str], what: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` with the engine's environment, in a session killed with it; a run past ``timeout``
    fails the test with its output."""
    try:
        return run_in_session(cmd, timeout=timeout, env=engine_env(), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what} ran past {timeout}s:\n{(exc.output or '')[-6000:]}")


@pytest.fixture(scope="module")
def engine_checks(sglang_venv_python) -> tuple[subprocess.CompletedProcess, dict]:
    """One run of ``host_checks.py`` (its docstring says what runs where) for the four tests below:
    a torchrun worker pair, as launch/train.sh starts the trainer (c10d rendezvous, which sets
    TORCHELASTIC_USE_AGENT_STORE in every worker)."""
    cmd = [str(sglang_venv_python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(CHECKS), str(POLICY), str(free_base_port(1, 2, local_ranks=2))]
    proc = run_in_venv(cmd, "host_checks.py", CHECKS_TIMEOUT_S)
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("VERDICT ")]
    assert verdicts, f"host_checks.py printed no verdict (exit {proc.returncode}):\n{proc.stdout[-6000:]}"
    verdict = json.loads(verdicts[-1].removeprefix("VERDICT "))
    assert "crashed" not in verdict, f"{verdict['crashed']}\n--- output ---\n{proc.stdout[-4000:]}"
    return proc, verdict


def checked(engine_checks, name: str) -> dict:
    """Section ``name`` of the verdict, with the transformers reference's own check; fails on a crash."""
    proc, verdict = engine_checks
    part = verdict.get(name)
    assert part is not None, f"no {name!r} checks in the verdict {verdict}:\n{proc.stdout[-6000:]}"
    assert "crashed" not in part, f"{name} checks crashed:\n{part['crashed']}\n--- output ---\n{proc.stdout[-4000:]}"
    return {**verdict.get("reference", {}), **part}


def assert_all_true(verdict: dict) -> None:
    failed = {k: v for k, v in verdict.items() if v is not True}
    assert not failed, json.dumps(failed, indent=1)


def test_real_engine_greedy_and_weight_update_session(engine_checks):
    """Greedy equals transformers; an update outside begin/end_weight_update is refused;
    inside the session it lands and greedy equals transformers with the new weights."""
    verdict = checked(engine_checks, "engine")
    assert_all_true(verdict)
    assert set(verdict) >= {"perturbation_changes_output", "plain_torch_layers", "greedy_matches_transformers",
                            "update_outside_session_refused", "update_in_session_succeeds",
                            "greedy_after_update_matches_transformers"}


def test_backend_on_real_engine_under_torchrun(engine_checks):
    """Our ``SGLangEngine`` on the real engine, in a torchrun worker of a c10d rendezvous:
    - the engine starts there (with torchrun's TORCHELASTIC_USE_AGENT_STORE inherited it hung waiting
      for a TCPStore nobody served);
    - ``update_weights``: generation afterwards equals transformers loaded with the pushed weights
      (sglang 0.5.23 refuses an update outside a session), and a refusal raises;
    - ``stats()`` reports the engine's KV capacity (32768 here) and its load (not an estimate of ours);
    - ``abort_all()`` then at once ``release_memory``/``resume_memory``: the release waits until sglang
      holds none of the aborted requests (released earlier, sglang's scheduler asserts an idle engine
      and SIGQUITs the process), and greedy output afterwards still equals transformers;
    - the engine's ready descriptor turns readable when a request finishes and a poll reads it empty
      (its server sleeps on it instead of polling the engine host);
    - requests evicted mid-decode and resubmitted with their tokens end as greedy requests that
      never moved (a hand-off's migration);
    - length replay: requests with stop tokens, sampled, each end at exactly its replayed length."""
    verdict = checked(engine_checks, "backend")
    assert_all_true(verdict)
    assert set(verdict) >= {"perturbation_changes_output", "under_torchrun_agent_store",
                            "engine_starts_under_torchrun", "worker_env_restored",
                            "backend_greedy_matches_transformers", "backend_update_weights_returns",
                            "backend_greedy_after_update_matches_transformers",
                            "backend_raises_when_sglang_refuses", "stats_kv_capacity_is_the_engines",
                            "stats_report_engine_load", "release_after_abort_waits_for_idle",
                            "aborted_requests_never_surface", "greedy_after_release_resume_matches_transformers",
                            "doorbell_rings_once_a_request_finishes", "evicted_then_resumed_equals_greedy",
                            "backend_length_replay_is_exact"}


def test_deterministic_race_on_real_engine(engine_checks):
    """``scheduler.race: deterministic`` over the real engine: ``progress`` counts come from sglang's
    stream (rising while a request decodes, below its final length, a resumed request starting at
    its tokens); short rounds with replayed lengths keep exactly the groups an oracle computes from
    those lengths, and a rerun whose scores arrive after random delays keeps the same groups with
    the same responses (race_checks.py)."""
    verdict = checked(engine_checks, "race")
    print("progress counts (every 4th read):", verdict.get("progress_streamed_counts"))
    print("kept (uid, epoch, responses) and deferred uids per short round:", verdict.get("race_ledger"))
    assert_all_true({k: v for k, v in verdict.items() if k not in ("progress_streamed_counts", "race_ledger")})
    assert set(verdict) >= {"progress_requests_finish", "progress_rises_while_decoding",
                            "progress_never_reaches_the_final_length", "progress_of_a_resumed_request_starts_at_its_tokens",
                            "progress_refused_for_unstreamed_requests", "race_keeps_the_oracles_groups",
                            "race_same_ledger_with_delayed_scores"}


def test_engine_hosts_on_real_engines(engine_checks):
    """One engine host process per engine, under torchrun with 2 ranks: rank 0 leads a TP-1 and a TP-2
    engine. Both take a weight push and then generate what transformers does with those weights;
    the TP-2 engine's shutdown ends its processes and spares the rank's other children; SIGTERM
    to the rank and its engine host reaches our handler and the engine keeps serving; a killed
    sglang scheduler makes poll(None) raise EngineDiedError instead of waiting forever; idle engines
    (both, between requests) sleep instead of spinning a core each."""
    verdict = checked(engine_checks, "hosts")
    print("CPU seconds of the idle engines' processes over 2 s:", verdict.get("idle_engine_cpu_seconds"))
    assert_all_true({k: v for k, v in verdict.items()
                     if k not in ("seconds_to_notice_death", "idle_engine_cpu_seconds")})
    assert set(verdict) >= {"one_engine_per_process", "tp1_greedy_after_push_matches_transformers",
                            "tp2_greedy_after_push_matches_transformers", "shutdown_ends_the_engines_processes",
                            "shutdown_spares_the_ranks_other_children", "sigterm_reaches_our_handler",
                            "engine_host_ignores_sigterm", "engine_serves_after_sigterm", "dead_scheduler_raises_instead_of_hanging",
                            "idle_engines_sleep"}
    proc, _ = engine_checks
    assert proc.returncode == 0, proc.stdout[-4000:]


GEN_PROMPTS = ({"prompt": "The capital of France is"}, {"prompt": "1 + 1 ="}, {"input_ids": [20, 21, 22, 40]})
GEN_TOKENS = 16


@pytest.fixture(scope="module")
def generate_reference() -> list[list[int]]:
    """Transformers' greedy output for ``GEN_PROMPTS``."""
    return transformers_greedy(GEN_PROMPTS, GEN_TOKENS)


def transformers_greedy(rows, new_tokens: int) -> list[list[int]]:
    """Greedy reference in this process: argmax of the full-sequence forward, no EOS stop."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(POLICY)
    model = Qwen2ForCausalLM.from_pretrained(POLICY, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for row in rows:
            ids = tok(row["prompt"])["input_ids"] if "prompt" in row else list(row["input_ids"])
            seq = list(ids)
            for _ in range(new_tokens):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            outs.append(seq[len(ids):])
    return outs


def test_generate_cli_on_real_engine_equals_transformers_greedy(sglang_venv_python, generate_reference, tmp_path):
    """``python -m rollpacker.generate --backend sglang`` on CPU (the backend's own CPU server args):
    greedy output equals transformers token for token, and the process exits by itself. (The
    backend's TP-2 engine under torchrun, whose TP ranks split the CPUs, is the long round's in
    ``test_training_program_on_real_engine_regroups_and_resumes_after_kill9`` and the engine hosts'
    in ``host_checks.py``; the CLI's torchrun path is tests/integration/test_engine_cli.py's.)"""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in GEN_PROMPTS))
    cmd = [str(sglang_venv_python), "-m", "rollpacker.generate", "--backend", "sglang", "--model", str(POLICY),
           "--input", str(src), "--output", str(out), "--temperature", "0", "--max-new-tokens", str(GEN_TOKENS),
           "--ignore-eos", "--sglang-base-port", str(free_base_port(1))]
    proc = run_in_venv(cmd, "rollpacker.generate", TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "(sglang, tp=1" in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, 0) for i in range(len(GEN_PROMPTS))]
    assert [r["output_ids"] for r in rows] == generate_reference
    assert all(len(r["logprobs"]) == GEN_TOKENS and all(lp <= 0 for lp in r["logprobs"]) for r in rows)


PROGRAM_STEPS = 3
PROGRAM_TIMEOUT_S = 900
# As tests/integration/test_train_program.py's runs (4 prompts x 4 responses), but each short round launches 6
# prompts and defers 2, so that step 3 is already the long round: every launch builds its engines,
# which costs far more than a step, so the runs take as few steps as show what they test. No profile
# rows, so the planner keeps short rounds on two TP-1 engines and regroups the long round to one TP-2
# engine over both ranks (rank 0 then leads engines of both TP sizes, each in its own host).
PROGRAM_ARGS = ["--config", "configs/tiny-cpu.yaml", "rollout.backend=sglang", "scheduler.p0=4", "scheduler.r0=4",
                "scheduler.eta_p=1.5", "rollout.max_response_length=384", "reward.num_workers=1",
                "scheduler.planner.profile=[]", f"run.steps={PROGRAM_STEPS}", "run.save_every=1",
                "run.keep_checkpoints=10", "run.wandb=disabled"]


def test_training_program_on_real_engine_regroups_and_resumes_after_kill9(sglang_venv_python, tmp_path):
    """The whole program on SGLang, ``torchrun --nproc_per_node 2 -m rollpacker.train`` on the tiny CPU
    config with ``rollout.backend=sglang``, as launch/train.sh starts it (c10d rendezvous):
    - a rank is killed with SIGKILL once the step-1 checkpoint is complete, before the run's end; the
      same command then resumes, and the ledger shows every prompt of the 3 steps trained exactly once;
    - short rounds ran on two TP-1 engines and the long round (step 3) on one TP-2 engine;
    - the trainer's log-probs of what the engine generated agree with the engine's every step, so each
      step's weight sync reached the engine that served the round (stale weights would show at once),
      and the step's mismatch diagnostics say the same."""
    from rollpacker.runtime.ledger import read_ledger

    out = tmp_path / "runs"
    run_dir = out / "sglang"

    def command(base_port: int) -> list[str]:
        return [str(sglang_venv_python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "-m", "rollpacker.train", *PROGRAM_ARGS, f"run.output_dir={out}", "run.name=sglang",
                f"rollout.sglang_base_port={base_port}", "run.eval.every=0", "run.eval.before_train=false"]

    t0 = time.monotonic()
    first = subprocess.Popen(command(free_base_port(1, 2, local_ranks=2)), env=engine_env(), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        marker = run_dir / "checkpoints" / "step_00000001" / "COMPLETE"
        deadline = time.monotonic() + PROGRAM_TIMEOUT_S
        while time.monotonic() < deadline and not marker.exists() and first.poll() is None:
            time.sleep(0.05)
        workers = [int(p) for p in subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True,
                                                  text=True).stdout.split()]
        if not (marker.exists() and workers):
            kill_group(first.pid)
            pytest.fail(f"no step 2 to kill:\n{first.communicate()[0].decode()[-6000:]}")
        t_marker = time.monotonic() - t0
        os.kill(workers[-1], signal.SIGKILL)
        output = first.communicate(timeout=300)[0].decode()
        t_exit = time.monotonic() - t0
        assert first.returncode != 0, output[-3000:]
    finally:
        kill_group(first.pid)  # the launch's session, however the test ends: no rank or engine runs on
        first.wait()
    assert "server_args={" in output and "'device': 'cpu'" in output, "no sglang engine was started"
    assert not (run_dir / "checkpoints" / f"step_{PROGRAM_STEPS:08d}").exists(), "the kill came after the run's end"

    proc = run_in_venv(command(free_base_port(1, 2, local_ranks=2)), "rollpacker.train on sglang (resumed)",
                       PROGRAM_TIMEOUT_S)
    print(f"step-1 checkpoint at {t_marker:.0f} s, killed launch ended at {t_exit:.0f} s, resumed launch ended at "
          f"{time.monotonic() - t0:.0f} s (nearly all of it the engines' start, twice)")
    assert proc.returncode == 0, proc.stdout[-8000:]
    trained, filtered = read_ledger(run_dir / "ledger.jsonl")
    assert max(trained.values()) == 1 and not filtered and len(trained) == PROGRAM_STEPS * 4
    metrics = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == list(range(1, PROGRAM_STEPS + 1))
    assert [metrics[s]["round"] for s in sorted(metrics)] == ["short", "short", "long"]
    assert {(m["round"], m["rollout_tp"]) for m in metrics.values()} == {("short", 1), ("long", 2)}
    for m in metrics.values():
        assert m["generated_tokens"] > 0 and m["train/sequences"] > 0 and m["sync/bytes"] > 0
        assert m["train/logprob_mismatch_max"] < CPU_SYNC_BOUND, m
        # the engine-trainer gap's diagnostics on the real engine (fp32 on CPU: KL ~4e-14 per token)
        assert 0 <= m["mismatch/kl_k3"] < 1e-9 and m[f"mismatch/{m['round']}/kl_k3"] == m["mismatch/kl_k3"], m
    assert (run_dir / "checkpoints" / f"step_{PROGRAM_STEPS:08d}" / "COMPLETE").exists()


MOE_CHECKS = CHECKS.parent / "moe_checks.py"


def test_qwen3_moe_on_real_engine(sglang_venv_python, tmp_path):
    """A random Qwen3-MoE checkpoint whose layers are all sparse, served by our ``SGLangEngine`` on
    the real engine with ``return_routing`` (``tests/sglang_cpu/moe_checks.py``): greedy output equals
    transformers' ``Qwen3MoeForCausalLM`` (fp32) token for token, and the routing the engine reports
    (``Completion.routed_experts``) names at every position of prompt and output, a resumed request's
    resumed tokens included, the experts transformers' router chooses, in its order; ``update_weights``
    pushes perturbed router and expert tensors in 1 MiB buckets (a layer's experts split between two),
    and greedy output and routing then equal transformers' with the pushed weights, the output
    differing from before. (The engine's routing capture needs the venv's
    ``shims/rollpacker_unpinned_capture.py`` on a host without CUDA.)

    What sglang cannot do: dense layers in a Qwen3-MoE model (``mlp_only_layers``,
    ``decoder_sparse_step``). sglang builds every Qwen3-MoE layer sparse
    (sglang 0.5.23 ``srt/models/qwen3_moe.py:878``, ``stage_facts``: ``is_layer_sparse = True``) and
    skips a dense layer's weights, serving another model; such checkpoints are refused at config
    time for ``rollout.backend=sglang`` (``rollpacker/config.py``)."""
    from testkit import make_random_qwen3_moe

    model = make_random_qwen3_moe(tmp_path / "qwen3-moe", seed=1, mlp_only_layers=[], moe_intermediate_size=96)
    cmd = [str(sglang_venv_python), str(MOE_CHECKS), str(model), str(free_base_port(1))]
    proc = run_in_venv(cmd, "moe_checks.py", TIMEOUT_S)
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("VERDICT ")]
    assert verdicts, f"moe_checks.py printed no verdict (exit {proc.returncode}):\n{proc.stdout[-6000:]}"
    verdict = json.loads(verdicts[-1].removeprefix("VERDICT "))
    assert "crashed" not in verdict, f"{verdict['crashed']}\n--- output ---\n{proc.stdout[-4000:]}"
    counts = ("tokens_equal_before", "tokens_equal_after", "positions_routed_equal_before",
              "positions_routed_equal_after", "pushed_tensors", "push_buckets")
    print("tokens equal to transformers before/after the push, positions routed as transformers before/after, "
          "pushed tensors, buckets:", *(verdict.get(k) for k in counts))
    assert_all_true({k: v for k, v in verdict.items() if k not in counts})
    assert set(verdict) >= {"perturbation_changes_output", "router_and_experts_pushed", "a_layers_experts_span_buckets",
                            "backend_greedy_matches_transformers", "backend_greedy_after_update_matches_transformers",
                            "routing_before_update_matches_transformers", "routing_after_update_matches_transformers",
                            "push_changes_engine_output", *counts}
    assert proc.returncode == 0, proc.stdout[-4000:]
