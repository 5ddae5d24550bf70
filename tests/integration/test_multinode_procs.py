"""Several nodes, emulated on this machine (``tests/multinode.py``: one torchrun agent per node).
(The job's shape at preflight, in one process: tests/unit/test_multinode.py.)

- 2 nodes x 2 ranks, the shipped example, one run: short rounds on four TP-1 engines, the long
  round regrouped to a TP-2 engine inside each node and node 1's handed to the stream trainer, the
  weight sync checked every step; a worker SIGKILLed mid long round, after which torchrun restarts
  both nodes' workers and they resume; then a whole node SIGKILLed, after which the survivors fail
  at once naming a lost rank; the same command relaunched finishes, every prompt trained once.
- SGLang, 2 nodes x 1 rank: a TP-1 engine in its engine host on each node, rank 0 driving node
  1's at node 1's address; the shipped config capped at preflight to what a node holds; the long
  round's node-1 engine handed to the stream trainer across nodes; validation on both nodes'
  engines; the weight sync checked every step.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.bounds import CPU_SYNC_BOUND
from rollpacker.control.transport import SILENT_PEER_S
from testkit import REPO_ROOT, free_base_port

sys.path.insert(0, str(Path(__file__).parent))  # the integration tests this one borrows from
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: multinode.py
from multinode import Cluster, connected, node_addr  # noqa: E402
from test_resume_shipped import _latest, _rows, _state, assert_no_prompt_lost_or_repeated  # noqa: E402
from test_train_program import FAST, POLICY  # noqa: E402

pytestmark = pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="shipped policy missing")

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"


# --- 2 nodes x 2 ranks, the shipped example ------------------------------------------------------

STEPS = ["run.steps=6", "run.save_every=1", "run.keep_checkpoints=10", "run.verify_sync=true", "run.wandb=disabled",
         # no profile rows: the planner starts long rounds at long_tp=2, one TP-2 engine per node
         "scheduler.planner.profile=[]",
         # the stream feed that sends each group to the first free replica, so that node 1's ranks are
         # sure to stream-train (under the deterministic race a replica gets only its own groups, in
         # prompt order: with 4 replicas and 4 groups it may get none before the rollout ends)
         "scheduler.race=first_finished"]
STOP_PROGRAM = REPO_ROOT / "tests" / "dist" / "train_stop_at.py"  # rollpacker.train, one rank stopping itself


def _two_by_two(run_dir: Path, logs: Path, stops: dict[int, tuple[str, int, int]] | None = None) -> Cluster:
    """The run's command on 2 nodes x 2 ranks; with ``stops`` (node -> point, rank, step), that rank
    of each node stops itself there (tests/dist/train_stop_at.py), its pid in ``logs/stopped<node>``."""
    def env(i: int) -> dict[str, str]:
        point, rank, step = stops[i]
        return dict(STOP_AT=point, STOP_RANK=str(rank), STOP_STEP=str(step), STOP_MARKER=str(logs / f"stopped{i}"))

    program = [str(STOP_PROGRAM)] if stops else ["-m", "rollpacker.train"]
    return Cluster(2, 2, [*program, "--config", str(TINY), f"run.output_dir={run_dir.parent}",
                          f"run.name={run_dir.name}", *FAST, *STEPS], logs=logs, max_restarts=1,
                   node_env=env if stops else lambda i: {})


def _stopped(cluster: Cluster, marker: Path, before: int | None = None) -> int:
    """The pid of the rank stopped at ``marker``'s point (another than ``before``), once stopped."""
    def there() -> bool:
        return marker.exists() and int(marker.read_text()) != before and _state(int(marker.read_text())) == "T"

    cluster.wait_until(there, f"a rank stopped at {marker}")
    return int(marker.read_text())


def test_two_nodes_regroup_stream_survive_a_worker_then_a_node_and_resume_exactly(tmp_path):
    run_dir, logs = tmp_path / "runs" / "nodes", tmp_path / "first"
    run_dir.parent.mkdir()
    started = time.monotonic()
    # Node 1: rank 2 stops as its stream trainer gets its first group in step 5's long round (node 1's
    # TP-2 engine handed to the trainer mid-round, node 0's decoding on). Node 0: rank 1 stops as it
    # enters step 6's rollout (a short round: rank 0 drives the four TP-1 engines, one of them stopped).
    with _two_by_two(run_dir, logs, stops={0: ("rollout", 1, 6), 1: ("stream_train", 2, 5)}) as first:
        ranks = first.ranks(4)
        assert {rank: node for rank, (_, node) in ranks.items()} == {0: 0, 1: 0, 2: 1, 3: 1}
        first.wait_until(lambda: connected(ranks[0][0], ranks[2][0], node_addr(1)),
                         "rank 0 connected to node 1's engine server at node 1's address")
        # (b) a worker SIGKILLed mid long round
        pid = _stopped(first, logs / "stopped1")
        assert pid == ranks[2][0] and [r["step"] for r in _rows(run_dir)] == [1, 2, 3, 4] and _latest(run_dir) == 4
        os.kill(pid, signal.SIGKILL)
        # torchrun restarts both nodes' workers, which resume from step 4; rank 2 stops there again
        os.kill(again := _stopped(first, logs / "stopped1", before=pid), signal.SIGCONT)
        restarted = first.ranks(4)
        assert "resumed from step 4 " in first.nodes[0].output() and restarted[2][0] == again
        assert all(restarted[r][0] != ranks[r][0] for r in range(4)), (ranks, restarted)
        # (c) node 1 lost (agent and workers SIGKILLed) in step 6's rollout
        assert _stopped(first, logs / "stopped0") == restarted[1][0]
        assert [r["step"] for r in _rows(run_dir)] == [1, 2, 3, 4, 5] and _latest(run_dir) == 5
        killed = time.monotonic()
        first.nodes[1].kill()
        os.kill(restarted[1][0], signal.SIGCONT)
        first.wait_until(lambda: not first.nodes[0].workers(), "node 0's ranks failing",
                         timeout=SILENT_PEER_S * 4, agents_may_exit=True)
        ranks_failed = time.monotonic() - killed
        # its agent now waits up to its rendezvous join_timeout for a node to take node 1's place
        # (under Slurm, srun --kill-on-bad-exit ends it at once); the with block ends it here
    survivor = first.nodes[0].output()
    lost = re.search(r"PeerLostError: rank [23], serving engine \d+, hung up \(tcp://127\.0\.0\.2:", survivor)
    print(f"node 1 lost: node 0's ranks failed after {ranks_failed:.1f}s; rank 0: {lost and lost.group(0)}")
    assert lost, survivor[-6000:]
    assert ranks_failed < SILENT_PEER_S  # at once: no keepalive probe needed, let alone a collective's timeout
    assert [r["step"] for r in _rows(run_dir)] == [1, 2, 3, 4, 5] and _latest(run_dir) == 5

    # the same command, relaunched as a new job (new rendezvous port and id), without a stop
    relaunched = time.monotonic()
    with _two_by_two(run_dir, tmp_path / "again") as relaunch:
        ranks = relaunch.ranks(4)
        relaunch.wait_until(lambda: connected(ranks[0][0], ranks[3][0], node_addr(1)),
                            "rank 0 connected to node 1's second rank at node 1's address")
        assert relaunch.wait() == [0, 0], relaunch.outputs()
    assert "resumed from step 5 " in relaunch.nodes[0].output()
    print(f"wall: first launch {relaunched - started:.0f}s, relaunch {time.monotonic() - relaunched:.0f}s")

    assert_no_prompt_lost_or_repeated(run_dir, steps=6)
    rows = _rows(run_dir)
    print([(r["step"], r["round"], r["rollout_tp"], r["streamed_groups"], r["migrated_requests"],
            r["sync/max_abs_diff"]) for r in rows])
    # four TP-1 engines in short rounds, one TP-2 engine per node (ranks 0-1 and 2-3) in the long one
    assert [(r["round"], r["rollout_tp"]) for r in rows] == [("short", 1)] * 4 + [("long", 2), ("short", 1)]
    assert [r["queue_length"] for r in rows] == [1, 2, 3, 4, 0, 1]
    assert all(r["groups"] == 4 and r["responses_kept"] == 16 for r in rows)
    assert all(r["sync/max_abs_diff"] == 0.0 for r in rows)  # every step's engines hold the trainer's weights
    # node 1's engine left mid-round for the stream trainer; what it still ran went on on node 0's (a
    # prompt's responses run on one engine: its groups may all be done by then, nothing to migrate)
    long = rows[4]
    assert 0.2 <= long["handoff_fraction"] <= 0.5 and long["streamed_groups"] > 0


# --- SGLang, 2 nodes x 1 rank --------------------------------------------------------------------

SGLANG_STEPS = 3


def _engine_hosts(rank_pid: int) -> int:
    """How many engine host processes (``rollpacker.rollout.sglang_host``) the rank runs."""
    try:
        return sum("rollpacker.rollout.sglang_host" in c.cmdline() for c in psutil.Process(rank_pid).children())
    except psutil.Error:  # the rank or a child gone meanwhile
        return 0


def test_sglang_engine_hosts_on_two_nodes_rank0_drives_the_other_nodes_engine(sglang_venv_python, tmp_path):
    """Each short round launches 6 prompts and defers 2 (``eta_p=1.5``), so step 3 is the long round;
    the planner, capped to TP 1, keeps both nodes' TP-1 engines in it, and node 1's leaves mid-round
    for the stream trainer (the hand-off needs the engines' KV capacity and load): its
    running requests go on on node 0's engine from their tokens so far (sglang continues them by
    prefill; the continuation is a fresh sample, see sglang_backend), and rank 1 trains the groups
    handed to it. Validation runs on the same engines after step 2 (inside step 3's round, after its
    sync) and after the last step, sharded over both nodes' engines: greedy and 4 samples at
    temperature 1 on 2 eval prompts."""
    from tests.sglang_cpu.env import engine_env

    python = str(sglang_venv_python)  # the suite's SGLang CPU venv (tests/conftest.py)
    run_dir = tmp_path / "runs" / "sglang"
    engine_ports = [free_base_port(1) for _ in range(2)]
    args = ["-m", "rollpacker.train", "--config", str(TINY), f"run.output_dir={run_dir.parent}",
            f"run.name={run_dir.name}", *FAST, "rollout.backend=sglang", f"run.steps={SGLANG_STEPS}",
            "scheduler.eta_p=1.5", "run.save_every=0", "run.wandb=disabled", "run.eval.every=2",
            "run.eval.max_prompts=2"]
    started = time.monotonic()
    with Cluster(2, 1, args, logs=tmp_path / "logs", python=python, env=engine_env(),
                 node_args=lambda i: [f"rollout.sglang_base_port={engine_ports[i]}"]) as cluster:
        ranks = cluster.ranks(2)
        assert {rank: node for rank, (_, node) in ranks.items()} == {0: 0, 1: 1}
        cluster.wait_until(lambda: connected(ranks[0][0], ranks[1][0], node_addr(1)),
                           "rank 0 connected to node 1's engine server at node 1's address")
        # each rank's TP-1 engine in an engine host process of its own, on its node
        cluster.wait_until(lambda: all(_engine_hosts(pid) == 1 for pid, _ in ranks.values()), "an engine host per rank")
        codes = cluster.wait(timeout=800)
        outputs = [n.output() for n in cluster.nodes]
    print(f"wall {time.monotonic() - started:.0f}s")
    assert codes == [0, 0], cluster.outputs()
    # the sglang engine rank 0 started (other ranks log warnings only)
    assert "server_args={" in outputs[0] and "'device': 'cpu'" in outputs[0] and "'tp_size': 1" in outputs[0]
    capped = "rollpacker: scheduler.planner capped to TP 1 (max_tp 2->1, long_tp 2->1, profile rows of TP [2] dropped)"
    assert outputs[0].count(capped) == 1 and capped not in outputs[1]  # rank 0's one line
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows, evals = [r for r in lines if "round" in r], [r for r in lines if "eval/seconds" in r]
    print([(r["step"], r["round"], r["rollout_tp"], r["generated_tokens"], r["handoff_fraction"],
            r["migrated_requests"], r["streamed_groups"], r["train/logprob_mismatch_max"]) for r in rows])
    print("eval lines:", [{k: v for k, v in e.items() if "/file/" not in k and "/source/" not in k} for e in evals])
    assert [(r["step"], r["rollout_tp"], r["round"]) for r in rows] == [(1, 1, "short"), (2, 1, "short"),
                                                                       (3, 1, "long")]
    for r in rows:  # the weight sync reached both engines: the trainer's log-probs agree with theirs
        assert r["generated_tokens"] > 0 and r["sync/bytes"] > 0 and r["responses_kept"] == 16
        assert r["train/logprob_mismatch_max"] < CPU_SYNC_BOUND, r
    long = rows[-1]  # node 1's engine left mid-round; what it still ran went on on node 0's
    assert 0.2 <= long["handoff_fraction"] <= 0.5 and long["streamed_groups"] > 0
    assert long["groups"] == 4
    assert [e["step"] for e in evals] == [2, SGLANG_STEPS]
    for e in evals:
        assert e["eval/engines"] == 2 and e["eval/greedy/samples"] == 2 and e["eval/t1/samples"] == 8
        assert 0 <= e["eval/greedy/pass@1"] <= 1 and 0 <= e["eval/t1/pass@1"] <= e["eval/t1/pass@4"] <= 1
        assert 0 < e["eval/t1/response_len_mean"] <= e["eval/t1/response_len_max"] <= 384
        assert e["eval/greedy/file/eval/pass@1"] == e["eval/greedy/source/stepchain/pass@1"] == e["eval/greedy/pass@1"]
    assert long["time/eval_s"] > 0  # the eval of step 2 ran inside step 3, on its timeline
