"""``bench.system.control`` at a tiny scale: rank 0 drives 2 then 4 engine endpoints over the real
coordinator channel (its own engine raced in-process, as in training), and its accounting holds:
every request reached an engine exactly once, every round kept its P0 groups, rank 0 sent exactly
the messages the endpoints answered, a round is one launch and one end per engine, rank 0 hears of
a group once (a push per completed group at most, none per response), and the overhead is rank
0's CPU over the modeled round. Replayed 10x faster than the model: none of this accounting
depends on the replay's speed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from bench.tools import report
from bench.system.control import R0, RESPONSES
from testkit import REPO_ROOT

ENGINES, ROUNDS = (2, 4), 2


def test_rank0_accounting_at_a_tiny_scale(tmp_path):
    out = tmp_path / "control.json"
    cmd = [sys.executable, "-m", "bench.system.control", "--engines", ",".join(map(str, ENGINES)),
           "--rounds", str(ROUNDS), "--hosts", "1", "--idle-s", "0.3", "--speed", "10", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(log)
    assert proc.returncode == 0, log
    r = json.loads(out.read_text())
    assert {"command", "commit", "date", "machine", "settings", "sizes"} <= set(r)
    assert [x["engines"] for x in r["sizes"]] == list(ENGINES)
    for x in r["sizes"]:
        n = x["engines"]
        requests = 2 * n * RESPONSES * ROUNDS  # P0 = 2 x engines prompts, 16 responses each, per round
        assert x["requests"] == requests and x["requests_per_round"] == 32 * n
        assert x["dispatched"] == requests and x["dispatched_twice"] == 0, "a request reached no engine or two"
        for rnd in x["rounds"]:
            assert rnd["kept_groups"] == 2 * n and rnd["samples"] == 2 * n * R0, rnd
            assert rnd["cpu_s"] >= rnd["main_thread_cpu_s"] > 0
            assert abs(rnd["overhead"] - rnd["projected_cpu_s"] / rnd["modeled_s"]) < 1e-12
        m = x["messages"]
        # engine 0 is rank 0's own, raced in this process: messages go to the other n - 1
        assert x["messages_sent_all"] == x["messages_answered_all"], "rank 0 and the endpoints disagree"
        remote = (n - 1) * ROUNDS
        assert m["launch"] == remote and m["end"] == remote, "a round is one launch and one end per engine"
        assert set(m) == {"launch", "end", "push"}, m  # no stats, polls, aborts or stops in a round
        assert 0 < m["push"] <= 2 * remote, m  # a push per completed group at most (2 per engine)
        assert sum(m.values()) == x["messages_per_round"] * ROUNDS
        total = {k: sum(rnd[k] for rnd in x["rounds"]) for k in ("projected_cpu_s", "modeled_s")}
        assert abs(x["overhead"] - total["projected_cpu_s"] / total["modeled_s"]) < 1e-12
        lat = x["launch_to_engine_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        print(f"{n} engines: rank 0 {x['cpu_s_per_round']:.3f} CPU s per round ({x['cpu_us_per_request']:.0f} us "
              f"per request, {x['overhead']:.2%} of the modeled {x['modeled_s_per_round']:.1f} s), "
              f"{x['messages_per_round']:.0f} messages per round {m}, launch -> engine p50 {lat['p50']:.0f} ms")
    assert "| 4 | 128 |" in report.control(r)
