"""Checkpoints, phase hand-offs and metrics: the program's plumbing, single process. The control plane's
collectives over 2 torchrun ranks: tests/integration/test_run_infra_procs.py."""
from __future__ import annotations

import json
import random

import pytest
import torch

from rollpacker.checkpoint import CheckpointManager
from rollpacker.metrics import MetricsLogger, Timeline, plot_timeline
from rollpacker.memory_phases import Phase, PhaseError, PhaseMachine


def test_checkpoint_roundtrip_restores_rng_and_state(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep=2)
    torch.manual_seed(3)
    random.seed(3)
    ckpt.save(5, {"w": torch.arange(4.0)}, {"queue": [1, 2, 3]})
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    rank_state, shared = ckpt.load(ckpt.latest())
    assert torch.equal(rank_state["w"], torch.arange(4.0)) and shared == {"queue": [1, 2, 3]}
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_checkpoint_keeps_last_n_and_ignores_incomplete(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"step": step})
    assert ckpt.steps() == [2, 3]
    # a save killed half-way leaves a .tmp directory without COMPLETE: never picked up
    broken = ckpt.path(4).with_name(ckpt.path(4).name + ".tmp")
    broken.mkdir()
    (broken / "rank00000.pt").write_bytes(b"partial")
    assert ckpt.latest() == 3
    assert ckpt.load(3)[0]["step"] == 3
    ckpt.save(4, {"step": 4})  # the next save replaces the partial one
    assert ckpt.steps() == [3, 4] and ckpt.load(4)[0]["step"] == 4


def test_checkpoint_wrong_world_size_is_explained(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(1, {})
    (ckpt.path(1) / "rank00000.pt").unlink()
    with pytest.raises(FileNotFoundError, match="different world size"):
        ckpt.load(1)


class _Recorder:
    def __init__(self, log):
        self.log = log

    def offload_optimizer(self):
        self.log.append("trainer.offload_optimizer")

    def offload(self):
        self.log.append("trainer.offload")

    def onload(self):
        self.log.append("trainer.onload")

    def release_memory(self, tags):
        self.log.append(f"engine.release{tuple(tags)}")

    def resume_memory(self, tags):
        self.log.append(f"engine.resume{tuple(tags)}")


def test_phase_machine_follows_the_handoff_table():
    calls: list[str] = []
    timeline = Timeline(rank=0)
    machine = PhaseMachine(_Recorder(calls), lambda: [_Recorder(calls)], timeline,
                           barrier=lambda: calls.append("barrier"))
    for phase in (Phase.SYNC, Phase.ROLLOUT, Phase.TRAIN, Phase.SYNC):
        machine.to(phase)
    # The engine's ranks meet between each trainer offload and the engine's resume, and between the
    # engine's release and the trainer's onload (a TP>1 engine's leader acts on every rank's device).
    # A sync holds the trainer's params alone beside the engine's weights.
    assert calls == [
        "trainer.offload_optimizer", "barrier", "engine.resume('weights',)",
        "trainer.offload", "barrier", "engine.resume('kv_cache', 'cuda_graph')",
        "engine.release('weights', 'kv_cache', 'cuda_graph')", "barrier", "trainer.onload",
        "trainer.offload_optimizer", "barrier", "engine.resume('weights',)",
    ]
    assert {s.phase for s in timeline.spans} == {"offload", "barrier", "onload"}
    assert any(k.startswith("handoff/rollout_to_train/") for k in machine.pop_seconds())
    with pytest.raises(PhaseError, match="no hand-off from sync to train"):
        machine.to(Phase.TRAIN)


def test_metrics_jsonl_and_resume_truncation(tmp_path):
    logger = MetricsLogger(tmp_path, rank=0, wandb_mode="disabled", project="p", name="n")
    for step in range(1, 5):
        logger.log(step, {"loss": torch.tensor(0.5 * step), "round": "short", "bad": float("nan")})
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4] and lines[1]["loss"] == 1.0 and lines[0]["bad"] == "nan"
    MetricsLogger(tmp_path, rank=0, wandb_mode="disabled", project="p", name="n", resume_step=2)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_timeline_image(tmp_path):
    tl = Timeline(rank=0)
    tl.record("rollout", 0.0, 2.0)
    tl.record("train", 2.0, 3.0)
    other = Timeline(rank=1)
    other.record("follow", 0.0, 2.0)
    path = plot_timeline(tl.gather() + other.gather(), tmp_path / "t.png", "step 1")
    assert path.stat().st_size > 5000 and tl.spans == []


@pytest.mark.parametrize("tp", [16, 3])
def test_a_rollout_engine_never_spans_nodes(tp):
    """2 nodes x 8 ranks: TP 16 would put one engine on both nodes, TP 3 straddles them;
    both are refused before any group is made."""
    from rollpacker.runtime.world import World
    world = World(rank=0, size=16, local_size=8, device=torch.device("cpu"), control=None)
    with pytest.raises(ValueError, match="never spans nodes"):
        world.build_rollout_layouts([tp])
