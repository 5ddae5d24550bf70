"""Validation during training (``run.eval``): the reward pool's code timeouts, and the real program.
(pass@k, the config, preflight's refusals and the eval rows, in one process: tests/unit/test_eval.py.)

The program tests share one pair of runs of ``configs/tiny-cpu.yaml`` (the suite's FAST overrides,
tail batching with the deterministic race, the default on CPU, so that which prompts a step trains does
not depend on timing, 4 steps, checkpoints
at 2 and 4): one with eval on (before training and every 2 steps, the shipped greedy and 4-sample
settings on 8 eval prompts), killed with SIGKILL during the eval of step 2 and again just after
that eval was logged, and resumed each time; one with eval off, uninterrupted.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollpacker.config import load_config
from rollpacker.eval import EvalRecord, summarize
from testkit import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent))  # the integration tests this one borrows from
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: procgroup.py
from procgroup import kill_group  # noqa: E402
from test_train_program import FAST, POLICY  # noqa: E402

CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"
TRAIN = [*FAST, "run.steps=4", "run.save_every=2", "run.keep_checkpoints=10",
         "run.wandb=disabled"]
EVAL_ON = ["run.eval.every=2", "run.eval.before_train=true", "run.eval.max_prompts=8"]  # the shipped samplings
needs_policy = pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="shipped policy missing")


def test_eval_scores_leave_the_code_timeouts_as_training_left_them():
    """The reward pool's code timeouts are training state (checkpointed): an eval response scored with
    ``adapt=False`` uses them but does not move them; the same response scored by training does."""
    from rollpacker.reward import RewardConfig, RewardPool

    echo = "```python\nprint(input())\n```"
    cases = [{"stdin": "a\n", "stdout": "a"}]
    with RewardPool(RewardConfig(num_workers=1)) as pool:
        before = pool.state_dict()
        assert pool.submit("code", echo, cases, adapt=False).result(timeout=60).correct
        assert pool.state_dict() == before
        assert pool.submit("code", echo, cases).result(timeout=60).correct
        print("anchors after a training score:", pool.state_dict())
        assert pool.state_dict() != before


# --- the real program ------------------------------------------------------------------------------
class Launch:
    """One ``torchrun -m rollpacker.train`` in a session of its own, its output in a file."""

    def __init__(self, run_dir: Path, log: Path, *overrides: str):
        self.log = log
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "rollpacker.train", "--config", str(CONFIG), f"run.output_dir={run_dir.parent}",
               f"run.name={run_dir.name}", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def rank_pid(self, rank: int) -> int:
        deadline = time.time() + 300
        while time.time() < deadline and self.proc.poll() is None:
            out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
            for pid in map(int, out.split()):
                try:
                    if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                        return pid
                except OSError:
                    pass
            time.sleep(0.05)
        pytest.fail(f"rank {rank} never started:\n{self.output()[-3000:]}")

    def kill_when(self, rank: int, condition, what: str) -> None:
        pid = self.rank_pid(rank)
        deadline = time.time() + 600
        while not condition():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                pytest.fail(f"never saw {what}:\n{self.output()[-4000:]}")
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        assert self.proc.wait(timeout=300) != 0

    def stop(self) -> None:
        kill_group(self.proc)  # and what a rank killed by -9 left (its reward workers)


def _lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _evals(run_dir: Path) -> list[dict]:
    return [r for r in _lines(run_dir) if "eval/seconds" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("eval")
    on, off = base / "runs" / "with_eval", base / "runs" / "without_eval"
    launches: list[Launch] = []
    try:
        reference = Launch(off, base / "off.log", *TRAIN)  # beside the others: much of a launch is waiting
        # 1. killed while the weights of step 2 are evaluated (in step 3, after its weight sync)
        launches.append(Launch(on, base / "launch1.log", *TRAIN, *EVAL_ON))
        launches[-1].kill_when(1, lambda: "eval of step 2: started" in launches[-1].output(), "the eval of step 2")
        # 2. killed just after that eval's line was written, before step 4's checkpoint
        launches.append(Launch(on, base / "launch2.log", *TRAIN, *EVAL_ON))
        launches[-1].kill_when(0, lambda: any(r["step"] == 2 for r in _evals(on)), "the eval of step 2 logged")
        # 3. the rest of the run
        launches.append(Launch(on, base / "launch3.log", *TRAIN, *EVAL_ON))
        launches.append(reference)
        for launch in launches[2:]:
            assert launch.proc.wait(timeout=900) == 0, launch.output()[-4000:]
    finally:
        for launch in [*launches, reference]:
            launch.stop()
    return on, off, [launch.output() for launch in launches]


@needs_policy
def test_eval_on_and_off_train_the_same_prompts_to_the_same_weights(runs):
    import torch
    from safetensors.torch import load_file

    on, off, _ = runs
    def ledger(run_dir: Path) -> list[tuple[int, list]]:  # a step's groups are listed as they completed
        lines = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
        return [(x["step"], sorted(x["trained"]), x["filtered"]) for x in lines]

    assert ledger(on) == ledger(off) and [x[0] for x in ledger(on)] == [1, 2, 3, 4]
    a = load_file(on / "checkpoints" / "step_00000004" / "hf" / "model.safetensors")
    b = load_file(off / "checkpoints" / "step_00000004" / "hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    moved = load_file(POLICY / "model.safetensors")
    assert any(not torch.equal(moved[k], a[k]) for k in moved if k in a)
    train_on = [r for r in _lines(on) if "round" in r]
    train_off = [r for r in _lines(off) if "round" in r]
    # (not generated_tokens: it counts what the requests a round aborted had made by its close, timing)
    for key in ("reward_mean", "train/loss", "train/grad_norm"):
        print(key, [r[key] for r in train_on], [r[key] for r in train_off])
        assert [r[key] for r in train_on] == [r[key] for r in train_off]
    assert not _evals(off) and not (off / "eval").exists()


@needs_policy
def test_kill9_during_an_eval_redoes_it_once_and_repeats_no_step(runs):
    on, _, (first, second, third, _) = runs
    lines = _lines(on)
    print("eval lines:", [(r["step"], round(r["eval/seconds"], 2), r["eval/greedy/pass@1"], r["eval/t1/pass@4"])
                          for r in _evals(on)])
    assert [r["step"] for r in lines if "round" in r] == [1, 2, 3, 4]  # each training step once
    assert [r["step"] for r in _evals(on)] == [0, 2, 4]  # each eval once
    assert "eval of step 0: started" in first and "eval of step 2: started" in first  # killed in it
    assert "resumed from step 2 " in second and second.count("eval of step 2: started") == 1  # redone
    assert "eval of step 0: started" not in second
    assert "resumed from step 2 " in third and "eval of step 2: started" not in third  # logged: not again
    assert "eval of step 4: started" in third
    # the eval before training ran inside step 1 (after its weight sync), on its timeline; step 3's line
    # comes from the last launch, where the eval of step 2 was not run again
    step = {r["step"]: r for r in lines if "round" in r}
    assert step[1]["time/eval_s"] > 0 and (on / "timeline" / "step_000001.png").exists()
    assert "time/eval_s" not in step[3]
    for r in _evals(on):
        assert r["eval/greedy/samples"] == 8 and r["eval/t1/samples"] == 32 and r["eval/engines"] == 2
        assert 0 <= r["eval/t1/pass@1"] <= r["eval/t1/pass@4"] <= 1


@needs_policy
def test_greedy_eval_equals_offline_generate_and_score_of_the_exported_checkpoint(runs, tmp_path):
    from transformers import AutoTokenizer

    from rollpacker.eval import eval_prompts

    on, _, _ = runs
    step = 2
    export = on / "checkpoints" / f"step_{step:08d}" / "hf"
    cfg = load_config(CONFIG, [*TRAIN, *EVAL_ON]).resolve(REPO_ROOT)
    tokenizer = AutoTokenizer.from_pretrained(export)
    ((key, prompts),) = eval_prompts(cfg, tokenizer)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": p.input_ids}) + "\n" for p in prompts))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-m", "rollpacker.generate", "--model", str(export), "--input",
                    str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--temperature", "0",
                    "--max-new-tokens", str(cfg.rollout.max_response_length)], cwd=REPO_ROOT, env=env, check=True)
    outs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    with (tmp_path / "samples.jsonl").open("w") as f:
        for p, o in zip(prompts, outs):
            f.write(json.dumps({"data_source": p.data_source, "ground_truth": p.ground_truth,
                                "response": tokenizer.decode(o["output_ids"], skip_special_tokens=True)}) + "\n")
    subprocess.run([sys.executable, "-m", "rollpacker.reward", "score", str(tmp_path / "samples.jsonl"), "-o",
                    str(tmp_path / "scores.jsonl")], cwd=REPO_ROOT, env=env, check=True)
    scores = [json.loads(x) for x in (tmp_path / "scores.jsonl").read_text().splitlines()]
    offline = summarize([EvalRecord("greedy", key, p.data_source, p.uid, 0, tuple(o["output_ids"]),
                                    o["finish_reason"], s["reward"], bool(s["correct"]))
                         for p, o, s in zip(prompts, outs, scores)])

    logged = next(r for r in _evals(on) if r["step"] == step)
    in_run = {k: v for k, v in logged.items() if k.startswith("eval/greedy/") and not k.endswith("/seconds")}
    print("in the run:", {k: v for k, v in in_run.items() if k.count("/") == 2})
    print("offline:   ", {k: v for k, v in offline.items() if k.count("/") == 2})
    samples = [json.loads(x) for x in (on / "eval" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    greedy = [s for s in samples if s["sampling"] == "greedy"]
    assert [s["response_ids"] for s in greedy] == [o["output_ids"] for o in outs]
    assert in_run == offline
