"""Multi-epoch traces, the correlated-epochs generator, the shuffled prompt
source and the epoch runner of the simulator."""
from __future__ import annotations

import json
import statistics

import pytest

from rollpacker.rollout.engine import GenerationRequest, SamplingParams
from rollpacker.sample import Prompt
from rollpacker.scheduler import ListPromptSource
from rollpacker.scheduler.config import HistoryConfig
from rollpacker.sim.__main__ import main
from rollpacker.sim.epochs import FIGURES, compare, run_epochs
from rollpacker.sim.run import SimSettings
from rollpacker.sim.traces import (LengthOracle, PromptLengths, TraceError, calibrate_rho, epoch_spearman,
                                   load_trace, multi_epoch_trace, parse_request_id, per_epoch)
from rollpacker.stats import spearman

MODEL = dict(samples=10, median=600.0, limit=16384)


def write(tmp_path, rows: list[dict | str]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def request(rid: str, seed: int | None = None) -> GenerationRequest:
    return GenerationRequest(rid, [0], SamplingParams(seed=seed))


def test_epoch_rows_gather_per_prompt_beside_plain_rows(tmp_path):
    path = write(tmp_path, [
        {"prompt_id": "a", "epoch": 1, "lengths": [7, 8], "prompt_length": 9},
        {"prompt_id": "b", "lengths": [3]},
        {"prompt_id": "a", "epoch": 0, "lengths": [5], "prompt_length": 9},
        {"prompt_id": "b", "lengths": [4]},  # a repeated plain id stays its own prompt, as before epochs
    ])
    a, b1, b2 = load_trace(path)
    assert a == PromptLengths("a", (5,), 9, {0: (5,), 1: (7, 8)})
    assert a.lengths_in(1) == (7, 8) and b1.lengths_in(5) == (3,) and b2.lengths == (4,)
    with pytest.raises(TraceError, match="prompt 'a' has no lengths for epoch 2; .* epochs \\[0, 1\\]"):
        a.lengths_in(2)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt_id": "a", "epoch": -1, "lengths": [3]}], ":1: epoch = -1; must be an integer >= 0"),
    ([{"prompt_id": "a", "epoch": "0", "lengths": [3]}], ":1: epoch = '0'"),
    ([{"prompt_id": "a", "epoch": True, "lengths": [3]}], ":1: epoch = True"),
    ([{"prompt_id": "a", "lengths": [3]}, {"prompt_id": "a", "epoch": 0, "lengths": [3]}],
     ":2: prompt_id 'a' has an 'epoch' here but none at "),
    ([{"prompt_id": "a", "epoch": 0, "lengths": [3]}, {"prompt_id": "a", "lengths": [3]}],
     ":2: prompt_id 'a' has no 'epoch' here but has one at "),
    ([{"prompt_id": "a", "epoch": 0, "lengths": [3]}, "", {"prompt_id": "a", "epoch": 0, "lengths": [4]}],
     ":3: prompt_id 'a' epoch 0 is already given at "),
    ([{"prompt_id": "a", "epoch": 0, "lengths": [3]}, {"prompt_id": "a", "epoch": 1, "lengths": [3],
                                                       "prompt_length": 5}],
     ":2: prompt_id 'a' has prompt_length 5 here but 256 at "),
])
def test_bad_epoch_rows_are_refused_with_the_line(tmp_path, rows, message):
    path = write(tmp_path, rows)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(err.value).startswith(path) and message in str(err.value)


def test_request_ids_carry_the_epoch():
    assert parse_request_id("p12e3r7") == (12, 3, 7)
    for bad in ("req-1", "p1r2", "p1exr2", "p1e2"):
        with pytest.raises(ValueError):
            parse_request_id(bad)


def test_oracle_reads_the_epoch_of_the_request():
    trace = [per_epoch("a", {0: (10, 11, 12), 1: (20, 21, 22)}), PromptLengths("b", (30, 31))]
    oracle = LengthOracle(trace, seed=3)
    assert [oracle(request(f"p0e{e}r{r}")) for e in (0, 1) for r in (0, 2)] == [10, 12, 20, 22]
    # a regenerated (deferred) prompt draws from its own epoch's list, reproducibly under the seed
    again = [oracle(request("p0e1r0")) for _ in range(20)]
    replay = LengthOracle(trace, seed=3)
    assert set(again) == {20, 21, 22} and [replay(request("p0e1r0")) for _ in range(21)][1:] == again
    # a migrated request (same id and sampling seed) keeps its length
    first = oracle(request("p0e1r1", seed=5))
    assert all(oracle(request("p0e1r1", seed=5)) == first for _ in range(3))
    # a prompt without epochs: one list for every epoch, attempts counting on across epochs (as before)
    assert oracle(request("p1e0r1")) == 31 and oracle(request("p1e4r0")) in (30, 31)
    with pytest.raises(TraceError, match="epoch 2"):
        oracle(request("p0e2r0"))
    assert LengthOracle(trace, last_epoch=1)(request("p0e7r2")) == 22


def test_generator_shapes_and_drift():
    trace = multi_epoch_trace(300, 3, rho=1.0, drift=0.3, **MODEL, seed=1)
    assert len(trace) == 300 and all(sorted(p.by_epoch) == [0, 1, 2] for p in trace)
    assert all(len(p.by_epoch[e]) == 10 and 1 <= min(p.by_epoch[e]) and max(p.by_epoch[e]) <= 16384
               for p in trace for e in range(3))
    medians = [statistics.median(n for p in trace for n in p.by_epoch[e]) for e in range(3)]
    assert medians[1] / medians[0] == pytest.approx(1.35, rel=0.1) and medians[2] > medians[1]
    assert multi_epoch_trace(5, 2, rho=0.5, **MODEL, seed=2) == multi_epoch_trace(5, 2, rho=0.5, **MODEL, seed=2)
    with pytest.raises(ValueError, match="rho"):
        multi_epoch_trace(5, 2, rho=1.5, **MODEL)


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take the mean rank: ranks [1.5, 1.5, 3] and [1, 2, 3]
    assert spearman([5, 5, 9], [1, 2, 3]) == pytest.approx(0.8660254, rel=1e-6)
    assert spearman([1, 1, 1], [1, 2, 3]) == 0.0


def test_realized_spearman_rises_with_rho_and_calibrates():
    realized = [epoch_spearman(multi_epoch_trace(400, 3, rho=rho, **MODEL, seed=0)) for rho in (0.0, 0.5, 0.9, 1.0)]
    assert realized == sorted(realized) and realized[0] < 0.15 and realized[-1] > 0.9
    flat = multi_epoch_trace(400, 3, rho=1.0, sigma_prompt=0.0, sigma_response=1.03, **MODEL, seed=0)
    assert abs(epoch_spearman(flat)) < 0.15
    for target in (0.9, 0.6, 0.3):
        rho = calibrate_rho(target, 400, 3, **MODEL, seed=0)
        assert epoch_spearman(multi_epoch_trace(400, 3, rho=rho, **MODEL, seed=0)) == pytest.approx(target, abs=0.01)
    with pytest.raises(ValueError, match="out of reach"):
        calibrate_rho(0.999, 400, 3, **MODEL, seed=0)


def test_shuffled_source_permutes_each_epoch_and_resumes_exactly():
    prompts = [Prompt(uid=i, input_ids=[i], data_source="t") for i in range(7)]
    plain = ListPromptSource(prompts)
    assert [p.uid for p in plain.take(9)] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    source = ListPromptSource(prompts, shuffle_seed=4)
    served = source.take(10)
    epochs = [[p.uid for p in served[:7]], [p.uid for p in served[7:]]]
    assert sorted(epochs[0]) == list(range(7)) and epochs[0] != list(range(7))
    assert [p.epoch for p in served] == [0] * 7 + [1] * 3
    state = source.state_dict()
    rest = [(p.uid, p.epoch) for p in source.take(12)]
    resumed = ListPromptSource(prompts, shuffle_seed=4)
    resumed.load_state_dict(state)
    assert [(p.uid, p.epoch) for p in resumed.take(12)] == rest
    epoch_1 = epochs[1] + [uid for uid, e in rest if e == 1]
    assert sorted(epoch_1) == list(range(7)) and epoch_1 != epochs[0]
    with pytest.raises(ValueError, match="shuffle_seed"):
        ListPromptSource(prompts, shuffle_seed=5).load_state_dict(state)


SMALL = SimSettings(model="7b", gpus=4, tp=1, p0=8, r0=4, limit=4096)


@pytest.mark.parametrize("mode, history", [("baseline", False), ("tail_batching", False), ("tail_batching", True)])
def test_every_prompt_is_trained_once_per_epoch(mode, history):
    trace = multi_epoch_trace(36, 3, rho=0.6, **{**MODEL, "limit": 4096, "median": 150.0}, seed=1)
    run = run_epochs(mode, SMALL, trace, 3, history=HistoryConfig(enabled=history), shuffle_seed=2)
    assert run.trained == {(uid, e) for uid in range(36) for e in range(3)}
    assert [f.trained_prompts for f in run.epochs] == [36, 36, 36]
    assert run.total.rounds == pytest.approx(3 * 36 / 8)  # P0 groups a round, shares summing to its kept groups
    assert all(f.rollout_seconds > 0 and f.generated_tokens >= f.wasted_tokens >= 0 for f in run.epochs)
    if mode == "baseline":
        assert run.total.wasted_tokens == 0


def test_compare_checks_the_prompts_and_splits_the_speedup():
    trace = multi_epoch_trace(32, 2, rho=0.9, **{**MODEL, "limit": 4096, "median": 150.0}, seed=0)
    base = run_epochs("baseline", SMALL, trace, 2, shuffle_seed=0)
    tail = run_epochs("tail_batching", SMALL, trace, 2, history=HistoryConfig(enabled=True), shuffle_seed=0)
    report = compare(base, tail)
    assert report["same_prompts"] and report["history"] and report["routed"] == tail.counters["routed"]
    total = report["total"]
    assert total["speedup"] == pytest.approx(total["baseline"]["rollout_seconds"]
                                             / total["tail_batching"]["rollout_seconds"])
    assert sum(e["tail_batching"]["rollout_seconds"] for e in report["per_epoch"]) == pytest.approx(
        total["tail_batching"]["rollout_seconds"])
    assert not compare(run_epochs("baseline", SMALL, trace, 1, shuffle_seed=0), tail)["same_prompts"]
    with pytest.raises(TraceError, match="prompt 'synthetic-0' has no lengths for epoch 2"):
        run_epochs("baseline", SMALL, trace, 3)


def test_cli_epochs_json(tmp_path, capsys):
    small = ["--model", "7b", "--gpus", "4", "--tp", "1", "--p0", "8", "--r0", "4", "--limit", "4096",
             "--num-prompts", "24"]
    assert main([*small, "--epochs", "2", "--json", "--rho", "0.8", "--history", "on"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [e["epoch"] for e in report["per_epoch"]] == [0, 1]
    for row in [*report["per_epoch"], report["total"]]:
        for mode in ("baseline", "tail_batching"):
            assert set(row[mode]) == set(FIGURES)
        assert row["speedup"] > 0
    assert report["same_prompts"] is True and report["history"] is True and isinstance(report["routed"], int)
    assert report["per_epoch"][1]["tail_batching"]["trained_prompts"] == 24
    assert 0 < report["epoch_spearman"] < 1
    # a trace file with per-epoch rows; the plain table
    trace = multi_epoch_trace(16, 2, rho=0.5, samples=5, median=150.0, limit=4096, seed=0)
    path = write(tmp_path, [{"prompt_id": p.prompt_id, "epoch": e, "lengths": list(p.by_epoch[e])}
                            for p in trace for e in (0, 1)])
    assert main([*small, "--trace", path, "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "same prompts trained per epoch: True" in out and out.count("\ntotal ") == 1
    for argv, message in [(["--history", "on"], "--history: only with --epochs"),
                          (["--epochs", "2", "--rounds", "3"], "--rounds and --epochs exclude each other"),
                          (["--epochs", "2", "--trace", path, "--drift", "0.1"], "--rho and --drift"),
                          (["--epochs", "0"], "--epochs must be >= 1"),
                          (["--trace", path, "--epochs", "3"], "has no lengths for epoch 2")]:
        assert main([*small, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
