"""Validation during training (``run.eval``): pass@k, the config, preflight, and the real program.

The program tests share one pair of runs of ``configs/tiny-cpu.yaml`` (the suite's FAST overrides,
baseline mode so that which prompts a step trains does not depend on timing, 4 steps, checkpoints
at 2 and 4): one with eval on (before training and every 2 steps, the shipped greedy and 4-sample
settings on 8 eval prompts), killed with SIGKILL during the eval of step 2 and again just after
that eval was logged, and resumed each time; one with eval off, uninterrupted.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollpacker.config import check_layout, load_config
from rollpacker.configlib import ConfigError
from rollpacker.eval import EvalConfig, EvalRecord, EvalSampling, pass_at_k, summarize
from rollpacker.testing import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent))
from procgroup import kill_group  # noqa: E402
from test_train_program import FAST, POLICY  # noqa: E402

CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"
TRAIN = [*FAST, "scheduler.mode=baseline", "run.steps=4", "run.save_every=2", "run.keep_checkpoints=10",
         "run.wandb=disabled"]
EVAL_ON = ["run.eval.every=2", "run.eval.before_train=true", "run.eval.max_prompts=8"]  # the shipped samplings
needs_policy = pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="shipped policy missing")


# --- pass@k and the metrics ----------------------------------------------------------------------
# Hand-made: per prompt, which of its 4 samples are correct.
TABLE = {0: [1, 0, 0, 0], 1: [1, 1, 0, 0], 2: [0, 0, 0, 0], 3: [1, 1, 1, 1], 4: [0, 1, 0, 1], 5: [0, 0, 0, 1]}


def _subsets_estimate(correct: list[int], k: int) -> float:
    """The quantity pass@k estimates, by enumeration: the share of k-subsets of the n samples with a
    correct one (drawing k without replacement)."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_the_unbiased_estimator_on_a_hand_made_table():
    for k in range(1, 5):
        per_prompt = [pass_at_k(4, sum(c), k) for c in TABLE.values()]
        enumerated = [_subsets_estimate(c, k) for c in TABLE.values()]
        print(f"pass@{k}: per prompt {per_prompt}")
        assert per_prompt == pytest.approx(enumerated, abs=1e-12)
    # by hand: 1 correct of 4, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == 0.5 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)

    # two files, two data sources; rewards differ from correctness (partial credit) on purpose
    records = [EvalRecord("t1", "a" if uid < 3 else "b", "math" if uid % 2 else "stepchain", uid, i,
                          tuple(range(10 * uid + i + 1)), "length" if uid == 3 and i == 0 else "stop",
                          0.5 + 0.5 * c if c else 0.1, bool(c))
               for uid, cs in TABLE.items() for i, c in enumerate(cs)]
    m = summarize(records)
    print({k: round(v, 4) for k, v in m.items() if "/file/" not in k and "/source/" not in k})
    assert m["eval/t1/pass@1"] == pytest.approx(sum(sum(c) / 4 for c in TABLE.values()) / 6)
    assert m["eval/t1/pass@4"] == pytest.approx(5 / 6)  # every prompt but 2 has a correct sample
    assert m["eval/t1/mean@4"] == pytest.approx(sum(r.reward for r in records) / 24)
    assert m["eval/t1/truncated_frac"] == pytest.approx(1 / 24)
    assert m["eval/t1/response_len_max"] == 54 and m["eval/t1/response_len_mean"] == pytest.approx(27.5)
    assert m["eval/t1/prompts"] == 6 and m["eval/t1/samples"] == 24
    # per file: a holds prompts 0-2, b holds 3-5
    assert m["eval/t1/file/a/pass@4"] == pytest.approx(2 / 3) and m["eval/t1/file/b/pass@4"] == 1.0
    assert "eval/t1/file/a/pass@2" not in m  # only pass@1 and pass@n are reported
    # per source: math holds prompts 1, 3, 5
    expect = sum(_subsets_estimate(TABLE[u], 1) for u in (1, 3, 5)) / 3
    assert m["eval/t1/source/math/pass@1"] == pytest.approx(expect)
    # greedy (n=1): pass@1 is the share correct, no pass@n beside it
    greedy = summarize([EvalRecord("greedy", "a", "math", u, 0, (1,), "stop", float(c[0]), bool(c[0]))
                        for u, c in TABLE.items()])
    assert greedy["eval/greedy/pass@1"] == greedy["eval/greedy/mean@1"] == pytest.approx(3 / 6)


def test_eval_config_schedule_and_refusals():
    cfg = EvalConfig(every=5)
    assert [s for s in range(0, 13) if cfg.due(s, last_step=12)] == [0, 5, 10, 12]
    assert [s for s in range(0, 13) if EvalConfig(every=0).due(s, 12)] == [0]  # before training only
    assert not EvalConfig(every=0, before_train=False).enabled(["x.jsonl"])
    assert not EvalConfig().enabled([])  # no eval files: no eval
    for bad, match in [(dict(every=-1), "every"), (dict(max_prompts=-2), "max_prompts"), (dict(samplings=[]), "samplings"),
                       (dict(samplings=[EvalSampling("a"), EvalSampling("a")]), "distinct")]:
        with pytest.raises(ConfigError, match=match):
            EvalConfig(**bad).validate()
    for bad, match in [(dict(n=0), "n must"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                       (dict(name="a/b"), "name")]:
        with pytest.raises(ConfigError, match=match):
            EvalSampling(**bad).validate()
    with pytest.raises(ConfigError, match="run.eval.samplings"):
        load_config(CONFIG, ["run.eval.samplings=[]"])
    shipped = load_config(CONFIG)
    assert shipped.run.eval.every == 5 and [(s.name, s.n, s.temperature) for s in shipped.run.eval.samplings] == \
        [("greedy", 1, 0.0), ("t1", 4, 1.0)]
    for name in ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen3-8b"):
        (aime,) = load_config(REPO_ROOT / "configs" / f"{name}.yaml").run.eval.samplings
        assert (aime.n, aime.temperature, aime.top_p) == (32, 1.0, 0.7)
    check_layout(load_config(CONFIG, ["data.eval_files=[]"]), 2, require_files=False)  # no files: no eval


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


@needs_policy
def test_preflight_refuses_unusable_eval_files_naming_file_and_reason(tmp_path, monkeypatch, capsys):
    from rollpacker.runtime.preflight import preflight

    good = json.dumps({"prompt": "Start at 3, apply +2 2 times mod 10.", "data_source": "stepchain",
                       "reward_model": {"ground_truth": "7"}})
    no_rows = tmp_path / "no_rows.jsonl"
    no_rows.write_text('{"prompt": ""}\n{"nonsense": 1}\n')
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not a parquet file")
    twin = tmp_path / "twin" / "eval.jsonl"
    twin.parent.mkdir()
    twin.write_text(good + "\n")
    cases = [
        ([tmp_path / "missing.jsonl"], "does not exist"),
        ([no_rows], "has no usable rows"),
        ([broken], "broken.parquet"),
        ([REPO_ROOT / "assets" / "data" / "eval.jsonl", twin], "['eval'] more than once"),
    ]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for files, reason in cases:
        with pytest.raises(SystemExit) as exit_:
            preflight(["--config", str(CONFIG), f"data.eval_files=[{', '.join(map(str, files))}]",
                       f"data.train_files=[{twin}]", f"run.output_dir={tmp_path}"])  # a one-row training file: quick to tokenize
        err = capsys.readouterr().err
        with capsys.disabled():
            print(err.strip())
        assert exit_.value.code == 2 and "cannot start" in err and "data.eval_files" in err and reason in err
        assert str(files[-1]) in err or "more than once" in err


@needs_policy
def test_bad_eval_rows_are_skipped_and_counted(tmp_path, caplog):
    from rollpacker.eval import eval_prompts
    from rollpacker.runtime.preflight import load_tokenizer

    rows = [{"prompt": f"Start at {i}, apply +2 2 times mod 10.", "data_source": "stepchain",
             "reward_model": {"ground_truth": str((i + 4) % 10)}} for i in range(3)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([json.dumps(rows[0]), '{"prompt": "x"}', json.dumps(rows[1]), "not json",
                               json.dumps(rows[2])]) + "\n")
    cfg = load_config(CONFIG, [f"data.eval_files=[{path}]"]).resolve(REPO_ROOT)
    with caplog.at_level("WARNING"):
        ((key, prompts),) = eval_prompts(cfg, load_tokenizer(cfg.model.path, cfg.source))
    print(caplog.text.strip())
    assert key == "mixed" and [p.uid for p in prompts] == [0, 2, 4]
    assert "skipped 2 of 5 rows" in caplog.text and "'missing_field': 1" in caplog.text and "'undecodable': 1" in caplog.text


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
    for key in ("reward_mean", "train/loss", "train/grad_norm", "generated_tokens"):
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
