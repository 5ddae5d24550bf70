"""The one-call GPU run (bench/gpu/run.py): its step runner on cheap stand-in steps, and its CPU dry
run of the real command on two cheap real checks (the CPU dry run of every check is
tests/integration/test_gpu_acceptance.py's).

The stand-in steps are ``python -c`` programs: one passes, one writes a partial result, starts a
process in a session of its own (as an SGLang engine host is started) and then hangs past its
budget, one reads the summary to see that the two before it were recorded before it started, one
needs more budget than is left, one fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench.gpu import run as gpu_run
from bench.gpu.acceptance import check_names, run_one
from bench.gpu.run import CPU_BUDGETS_S, GPU_BUDGETS_S, MAX_OUT_FILES, Run, Step, priority

REPO = Path(__file__).resolve().parents[2]

PASSES = "import json, sys; json.dump({'ok': True, 'figure': 1.5}, open(sys.argv[1], 'w'))"
HANGS = """
import json, subprocess, sys, time
json.dump({'stage': 'one', 'ok': False, 'partial': True}, open(sys.argv[1], 'w'))
orphan = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'], start_new_session=True)
open(sys.argv[2], 'w').write(str(orphan.pid))
time.sleep(3600)
"""
READS_SUMMARY = """
import json, sys
steps = json.load(open(sys.argv[2]))['steps']
json.dump({'ok': True, 'seen': {k: steps[k]['status'] for k in ('a/passes', 'b/hangs')}}, open(sys.argv[1], 'w'))
"""
FAILS = "import sys; print('boom: the stand-in failed', file=sys.stderr); sys.exit(3)"


def test_steps_run_in_order_each_within_its_budget_and_the_summary_is_written_after_each(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    orphan_pid = tmp_path / "orphan.pid"
    py = sys.executable
    steps = [Step("setup/first", [py, "-c", "print('set up')"], 60, check=False),
             Step("a/passes", [py, "-c", PASSES, str(work / "a.json")], 60, work / "a.json"),
             # the budget is the event under test; long enough for a loaded machine to start Python
             Step("b/hangs", [py, "-c", HANGS, str(work / "b.json"), str(orphan_pid)], 8, work / "b.json"),
             Step("c/reads_summary", [py, "-c", READS_SUMMARY, str(work / "c.json"), str(out / "summary.json")], 60,
                  work / "c.json"),
             Step("d/too_big", [py, "-c", "raise SystemExit('must not run')"], 10_000),
             Step("e/fails", [py, "-c", FAILS], 60)]
    run = Run(out, work, budget_s=600, header={"date": "today", "device": "cpu", "python": "3", "commit": "x",
                                                 "command": "test"})
    run.pending(steps)
    pending = json.loads((out / "summary.json").read_text())["steps"]
    assert list(pending) == [s.name for s in steps] and {e["status"] for e in pending.values()} == {"pending"}
    run.execute(steps, dict(os.environ))
    assert run.finish() == 1  # a step timed out and one failed

    summary = json.loads((out / "summary.json").read_text())
    steps_out = summary["steps"]
    assert list(steps_out) == [s.name for s in steps]
    assert [e["status"] for e in steps_out.values()] == ["passed", "passed", "timed out", "passed", "not started",
                                                         "failed"]
    assert steps_out["a/passes"]["result"] == {"ok": True, "figure": 1.5}
    hung = steps_out["b/hangs"]
    assert hung["partial"]["stage"] == "one" and "result" not in hung
    assert not gpu_run._alive(int(orphan_pid.read_text()))  # its own session did not save it
    assert steps_out["c/reads_summary"]["result"]["seen"] == {"a/passes": "passed", "b/hangs": "timed out"}
    assert steps_out["d/too_big"]["reason"] == "budget" and steps_out["d/too_big"]["left_s"] < 10_000
    assert steps_out["e/fails"]["exit"] == 3 and steps_out["e/fails"]["error"] == "boom: the stand-in failed"
    log = (out / "log.txt").read_text()
    assert "--- e/fails: the last lines of its output ---\nboom: the stand-in failed" in log
    assert "d/too_big: not started: needs 10000 s" in log
    report = (out / "summary.md").read_text()
    assert "| b/hangs | timed out |" in report and "stage=one" in report and "| d/too_big | not started |" in report
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "summary.json", "summary.md"]


def test_a_run_whose_steps_pass_exits_0_even_with_checks_left_unstarted(tmp_path):
    run = Run(tmp_path / "out", tmp_path / "work", budget_s=100, header={
        "date": "today", "device": "cpu", "python": "3", "commit": "x", "command": "test"})
    steps = [Step("a/passes", [sys.executable, "-c", PASSES, str(tmp_path / "a.json")], 60, tmp_path / "a.json"),
             Step("b/later", [sys.executable, "-c", "pass"], 1_000)]
    run.pending(steps)
    run.execute(steps, dict(os.environ))
    assert run.finish() == 0


def test_every_check_has_a_budget_and_the_sglang_checks_come_first():
    for device, budgets in (("cuda", GPU_BUDGETS_S), ("cpu", CPU_BUDGETS_S)):
        assert set(budgets) == set(check_names(torch.device(device))), device
    gpu = priority(check_names(torch.device("cuda")), "qwen2.5-0.5b-shape", "qwen2.5-7b-widths-4l")
    assert gpu[:5] == ["qwen2.5-0.5b-shape/sglang_engine", "program/sglang_baseline_vs_tail_batching",
                       "policy/sglang_race_ledger", "qwen2.5-7b-widths-4l/trainer_throughput",
                       "qwen2.5-0.5b-shape/trainer_throughput"]
    assert sorted(gpu) == sorted(check_names(torch.device("cuda")))
    cpu = priority(check_names(torch.device("cpu")), "tiny-random", "tiny-widths")
    assert cpu[:4] == ["policy/sglang_engine", "program/sglang_baseline_vs_tail_batching",
                       "tiny-widths/trainer_throughput", "tiny-random/trainer_throughput"]


def test_a_check_with_stages_leaves_its_partial_result_when_it_dies(tmp_path, monkeypatch):
    """``bench.gpu.acceptance check`` writes a staged check's result after each stage, marked partial."""
    from bench.gpu import acceptance as gpu_acceptance

    def staged(device, work, progress, profile_dir):
        def check():
            progress({"kv": {"ok": True}})
            raise RuntimeError("killed mid-check")
        return {"x/staged": check}

    monkeypatch.setattr(gpu_acceptance, "check_table", staged)
    monkeypatch.setattr(gpu_acceptance, "make_shape_model", lambda device, work: None)
    result = tmp_path / "r.json"
    try:
        run_one(torch.device("cpu"), tmp_path, "x/staged", result)
    except RuntimeError:
        pass
    assert json.loads(result.read_text()) == {"kv": {"ok": True}, "ok": False, "partial": True}


def test_cpu_dry_run_of_the_gpu_command_runs_the_chosen_checks_in_order(tmp_path):
    """The real command on CPU, on two cheap checks (``--only``): the trainer's throughput at the
    dry run's widths and shape, each with its profile in OUT; every other check is recorded as not
    selected."""
    out = tmp_path / "out"
    chosen = ["tiny-random/trainer_throughput", "tiny-widths/trainer_throughput"]
    proc = subprocess.run([sys.executable, "-m", "bench.gpu.run", "--device", "cpu", "--budget-s", "900",
                           "--out", str(out), "--work", str(tmp_path / "work"), "--only", *chosen],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:], {n: steps[n] for n in chosen})
    ran = [n for n, e in steps.items() if e["status"] != "not started"]
    assert ran == ["tiny-widths/trainer_throughput", "tiny-random/trainer_throughput"]  # priority order
    assert all(steps[n]["status"] == "passed" and steps[n]["result"]["tokens_per_s"] > 0 for n in ran)
    assert all(e["reason"] == "not selected (--only)" for n, e in steps.items() if n not in ran)
    assert set(steps) == set(check_names(torch.device("cpu")))
    files = sorted(p.name for p in out.iterdir())
    assert files == ["log.txt", "profile-tiny-random.txt", "profile-tiny-widths.txt", "summary.json", "summary.md"]
    assert len(files) <= MAX_OUT_FILES
    assert "Self CPU" in (out / "profile-tiny-widths.txt").read_text()
    assert "| tiny-widths/trainer_throughput | passed |" in (out / "summary.md").read_text()
