"""The CPU example's W&B run, read back with wandb's own reader (`wandb leet inspect --json`).

Two steps of the shipped program, over-launching twice the prompts a step trains so that step 1
(short round) defers four prompts and step 2 is the long round that trains them, handing an engine
to the stream trainer midway; the starting policy is evaluated first. Checked: the sections are
declared with define_metric and hold the step's metrics; the completions table of each step agrees
with the ledger, the step's metrics and the dataset; the rollout Gantt is the file saved in the run
directory, logged as an image, and shows the outcomes of its step.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rollpacker.metrics import SECTIONS
from rollpacker.rollout_report import MIGRATED_COLOUR, OUTCOME_COLOURS, TABLE_COLUMNS
from rollpacker.scheduler.round import Outcome
from testkit import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent))
from test_train_program import POLICY, _lines, _metrics, _train  # noqa: E402

pytestmark = pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="shipped policy missing")
P0, R0 = 4, 4  # the FAST overrides of test_train_program


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("wandb") / "run"
    _train(run_dir, "run.steps=2", "run.save_every=0", "scheduler.eta_p=2.0", "run.eval.before_train=true",
           "run.eval.max_prompts=4")
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(files[0])],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    history = {}
    for rec in records:
        if rec["type"] == "history":
            history.setdefault(int(rec["history"]["step"]["num"]), {}).update(rec["history"]["item"])
    ledger = {r["step"]: r for r in map(json.loads, (run_dir / "ledger.jsonl").read_text().splitlines())}
    return run_dir, files[0].parent / "files", records, history, ledger


def _table(run, step: int) -> list[dict]:
    run_dir, files, _, history, _ = run
    item = history[step]
    assert item["rollout/completions._type"] == "table-file"
    table = json.loads((files / item["rollout/completions.path"]).read_text())
    assert table["columns"] == list(TABLE_COLUMNS)
    return [dict(zip(table["columns"], row)) for row in table["data"]]


def test_sections_are_declared_and_hold_the_step_metrics(run):
    run_dir, _, records, history, _ = run
    declared = {m["metric"].get("glob_name") or m["metric"].get("name"): m["metric"]
                for m in records if m["type"] == "metric"}
    print("define_metric:", sorted(declared))
    assert {f"{s}/*" for s in SECTIONS} <= declared.keys()
    assert all(declared[f"{s}/*"]["step_metric"] == "step" for s in SECTIONS)
    assert declared["step"]["options"].get("hidden") is True
    lines = {r["step"]: r for r in _metrics(run_dir)}
    evals = [r for r in _lines(run_dir) if "eval/seconds" in r]
    assert [e["step"] for e in evals] == [0] and history[0]["eval/greedy/pass@1"] == evals[0]["eval/greedy/pass@1"]
    for step, line in lines.items():
        item = history[step]
        keys = {k.split(".")[0] for k in item if not k.startswith("_") and k != "step"}
        assert all(k.split("/")[0] in SECTIONS for k in keys), sorted(k for k in keys if "/" not in k)
        assert item["step"] == step
        assert item["reward/mean"] == pytest.approx(line["reward_mean"])
        assert item["reward/accuracy"] == pytest.approx(line["accuracy"])
        assert item["perf/rollout_s"] == pytest.approx(line["rollout_s"])
        assert item["perf/time/step_s"] == pytest.approx(line["time/step_s"])
        assert item["rollout/generated_tokens"] == line["generated_tokens"]
        assert item["train/loss"] == pytest.approx(line["train/loss"])
    print("sections per step:", {s: sorted({k.split("/")[0] for k in history[s] if "/" in k}) for s in lines})


def test_completions_table_agrees_with_the_ledger_and_the_step(run):
    run_dir, _, _, _, ledger = run
    lines = {r["step"]: r for r in _metrics(run_dir)}
    data = [json.loads(x) for x in (REPO_ROOT / "assets" / "data" / "train.jsonl").read_text().splitlines()]
    assert [lines[s]["round"] for s in (1, 2)] == ["short", "long"]
    tables = {s: _table(run, s) for s in (1, 2)}
    for step, rows in tables.items():
        line = lines[step]
        outcomes = Counter(r["outcome"] for r in rows)
        print(f"step {step} ({line['round']}): {len(rows)} rows {dict(outcomes)}, "
              f"{sum(r['migrated'] for r in rows)} migrated")
        assert len(rows) == line["responses_launched"]  # at most 64 launched: every request is a row
        trained = [r for r in rows if r["outcome"] == Outcome.TRAINED.value]
        assert {(r["uid"], r["epoch"]) for r in trained} == {tuple(x) for x in ledger[step]["trained"]}
        assert len(trained) == line["responses_kept"] == P0 * R0
        assert set(Counter((r["uid"], r["epoch"]) for r in trained).values()) == {R0}
        assert np.mean([r["reward"] for r in trained]) == pytest.approx(line["reward_mean"])
        assert max(r["response_tokens"] for r in trained) == line["response_len_max"]
        assert all(r["finish_reason"] in ("stop", "length") and r["response_tokens"] > 0 for r in trained)
        deferred = {(r["uid"], r["epoch"]) for r in rows if r["outcome"] == Outcome.DEFERRED.value}
        assert len(deferred) == line["deferred_prompts"]
        assert sum(r["migrated"] for r in rows) == line["migrated_requests"]
        for r in rows:
            assert (r["round"], r["engine_tp"]) == (line["round"], line["rollout_tp"])
            assert r["data_source"] == data[r["uid"]]["data_source"]
            assert data[r["uid"]]["prompt"][-1]["content"] in r["prompt"]
            if r["finish_reason"] is None:  # aborted or deferred while generating: its tokens were dropped
                assert r["outcome"] in ("aborted", "deferred") and r["reward"] is None and r["response"] == ""
    # step 1, the short round: 8 prompts x 5 responses; a kept group's fifth response was aborted,
    # the 4 incomplete groups went to the queue, and step 2's long round trained exactly those
    short, long = tables[1], tables[2]
    launched = lines[1]["responses_launched"] // lines[1]["prompts_launched"]
    assert Counter(r["outcome"] for r in short) == {"trained": P0 * R0, "aborted": P0 * (launched - R0),
                                                    "deferred": P0 * launched}
    assert {(r["uid"], r["epoch"]) for r in short if r["outcome"] == "deferred"} == \
        {tuple(x) for x in ledger[2]["trained"]}
    assert lines[1]["queue_length"] == P0 and lines[1]["migrated_requests"] == 0
    # step 2, the long round: exactly R0 responses per prompt, all trained; an engine left for the
    # stream trainer and what it still ran moved to the engine that stayed. How much that was
    # depends on timing: on loaded cores rank 0 may hear of the leaving engine's completions only
    # after it finished them all (the migration itself: test_scheduler's hand-off tests)
    assert {r["outcome"] for r in long} == {"trained"} and len(long) == P0 * R0
    assert 0.2 <= lines[2]["handoff_fraction"] <= 0.5
    assert all(r["engine"] == 0 for r in long if r["migrated"])


def _has_colour(png: Path, colour: str) -> bool:
    import matplotlib.image

    pixels = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int).reshape(-1, 3)
    want = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    return bool((np.abs(pixels - want).max(axis=1) <= 2).any())


def test_rollout_gantt_is_saved_and_logged_as_an_image(run):
    run_dir, files, _, history, _ = run
    for step in (1, 2):
        png = run_dir / "timeline" / f"step_{step:06d}_requests.png"
        item = history[step]
        assert item["rollout/gantt._type"] == "image-file" and item["perf/timeline._type"] == "image-file"
        logged = files / item["rollout/gantt.path"]
        assert hashlib.sha256(png.read_bytes()).hexdigest() == item["rollout/gantt.sha256"] == \
            hashlib.sha256(logged.read_bytes()).hexdigest()
        print(f"step {step}: {png.name} {item['rollout/gantt.width']}x{item['rollout/gantt.height']}")
    # the colours of the outcomes each step had: the short round's aborted and deferred requests,
    # the long round's migrated ones; none of a step's absent outcomes
    gantt = {s: run_dir / "timeline" / f"step_{s:06d}_requests.png" for s in (1, 2)}
    for outcome in (Outcome.TRAINED, Outcome.ABORTED, Outcome.DEFERRED):
        assert _has_colour(gantt[1], OUTCOME_COLOURS[outcome]), outcome
    assert not _has_colour(gantt[1], MIGRATED_COLOUR)
    migrated = {r["step"]: r for r in _metrics(run_dir)}[2]["migrated_requests"]
    print(f"step 2: {migrated} requests migrated at the hand-off")
    assert _has_colour(gantt[2], MIGRATED_COLOUR) is (migrated > 0)
    assert _has_colour(gantt[2], OUTCOME_COLOURS[Outcome.TRAINED])
    assert not _has_colour(gantt[2], OUTCOME_COLOURS[Outcome.DEFERRED])


def test_the_gantt_draws_a_migrated_requests_time_on_the_engine_it_left(tmp_path):
    from rollpacker.rollout_report import plot_gantt
    from rollpacker.sample import Prompt, Sample
    from rollpacker.scheduler.round import RequestTrace, RoundTrace

    def trace(moved: bool) -> RoundTrace:
        sample = Sample(Prompt(uid=0, input_ids=[1], data_source="d"), 0)
        stay = RequestTrace(sample, Outcome.TRAINED, ((0, 0.0, 2.0),))
        move = RequestTrace(sample, Outcome.TRAINED, ((1, 0.0, 1.0), (0, 1.0, 3.0)) if moved else ((1, 0.0, 0.8),))
        return RoundTrace(engines=2, build=lambda: [stay, move], closed_at=3.0, handoff_at=1.0, released=(1,))

    drawn = {moved: _has_colour(plot_gantt(trace(moved), tmp_path / f"moved_{moved}.png", "hand-off"), MIGRATED_COLOUR)
             for moved in (True, False)}
    print(f"migrated colour drawn, with a migrated request: {drawn[True]}; without: {drawn[False]}")
    assert drawn == {True: True, False: False}


def test_a_big_step_shows_64_requests_in_launch_order_with_every_outcome():
    from rollpacker.rollout_report import MAX_TABLE_ROWS, pick_requests
    from rollpacker.sample import Prompt, Sample
    from rollpacker.scheduler.round import RequestTrace

    # a GPU-sized short round: 2,000 requests, 3 of them migrated and 1 filtered
    kinds = [(Outcome.TRAINED, 1)] * 1000 + [(Outcome.ABORTED, 1)] * 600 + [(Outcome.DEFERRED, 1)] * 396 + \
        [(Outcome.TRAINED, 2)] * 3 + [(Outcome.FILTERED, 1)]
    requests = [RequestTrace(Sample(Prompt(uid=i, input_ids=[1], data_source="d"), 0), outcome,
                             tuple((e, 0.0, 1.0) for e in range(engines))) for i, (outcome, engines) in enumerate(kinds)]
    picked = pick_requests(requests)
    seen = Counter((r.outcome, r.migrated) for r in picked)
    print(dict(seen))
    assert len(picked) == MAX_TABLE_ROWS
    assert [r.sample.prompt.uid for r in picked] == sorted(r.sample.prompt.uid for r in picked)
    assert seen[Outcome.FILTERED, False] == 1 and seen[Outcome.TRAINED, True] == 3  # all of the rare ones
    assert seen[Outcome.TRAINED, False] == seen[Outcome.ABORTED, False] == seen[Outcome.DEFERRED, False] == 20
    deferred = [r.sample.prompt.uid for r in picked if r.outcome is Outcome.DEFERRED]
    assert deferred[0] == 1600 and deferred[-1] > 1950  # spread over the deferred ones, not the first 20
    assert pick_requests(requests[:MAX_TABLE_ROWS]) == requests[:MAX_TABLE_ROWS]
