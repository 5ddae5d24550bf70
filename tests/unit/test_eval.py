"""Validation during training (``run.eval``), in one process: pass@k, the config, preflight's refusals and
the eval rows. The real program's evals (killed and resumed, on and off, against offline scoring) and the
reward pool's code timeouts: tests/integration/test_eval_procs.py.
"""
from __future__ import annotations

import itertools
import json

import pytest

from rollpacker.config import check_layout, load_config
from rollpacker.configlib import ConfigError
from rollpacker.eval import EvalConfig, EvalRecord, EvalSampling, pass_at_k, summarize
from testkit import REPO_ROOT

POLICY = REPO_ROOT / "assets" / "policy"
CONFIG = REPO_ROOT / "configs" / "tiny-cpu.yaml"
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
