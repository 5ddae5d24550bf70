"""The Trainer over 2 torchrun ranks: TP=2 reproduces TP=1's steps, and PP=2's schedule gets the group
arguments megatron-core accepts. The one-process Trainer: tests/unit/test_trainer.py."""
from __future__ import annotations

import json

import pytest

from testkit import make_random_qwen3, make_random_qwen3_moe, run_torchrun
from rollpacker.trainer.config import TrainerConfig
from rollpacker.trainer.trainer import Trainer
from tests.dist.trainer_tp import EP_STEP_CONFIG, STEP_CONFIG, two_steps
from tests.unit.test_trainer import layout, model_dir  # noqa: F401 - the same fixtures


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_tensor_parallel_steps_match_single_rank(layout, model_dir, tmp_path, family):
    """Vocab-parallel loss, TP-duplicate-aware grad norm, KL swap: TP=2 reproduces TP=1.
    Qwen3: its replicated q/k norms see only their rank's heads, so their gradients must be summed
    over TP (the grad norm and the second step would differ otherwise)."""
    if family == "qwen3":
        model_dir = make_random_qwen3(tmp_path / "qwen3", seed=11)
    if family == "qwen3_moe":  # sequence parallelism (megatron-core trains MoE with TP only so)
        model_dir = make_random_qwen3_moe(tmp_path / "qwen3_moe", seed=11)
    out = tmp_path / "tp2.json"
    run_torchrun(2, ["tests/dist/trainer_tp.py", str(model_dir), str(out)], timeout=300)
    assert_same_steps(two_steps(Trainer(TrainerConfig(**STEP_CONFIG), model_dir, layout)), json.loads(out.read_text()))


def assert_same_steps(one_rank: list[dict], two_ranks: list[dict]) -> None:
    for a, b in zip(one_rank, two_ranks):
        print({k: (a[k], b[k]) for k in ("loss", "grad_norm", "kl", "tokens")})
        for key in ("loss", "grad_norm", "entropy", "kl", "tokens", "skipped"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    assert two_ranks[1]["kl"] > 0  # the second step sees the first update


def test_pipeline_schedule_gets_the_group_arguments_megatron_accepts():
    """PP > 1 on GPU runs Megatron's pipelined schedule; megatron-core 0.16.1 validates its group
    arguments before anything else, so a CPU run of 2 real ranks proves the call is accepted."""
    proc = run_torchrun(2, ["tests/dist/pipeline_schedule.py", "assets/policy"], timeout=300)
    # per rank: our arguments accepted, then the old call (pg_collection alone) refused; the two
    # ranks share one pipe, so count words rather than lines
    assert proc.stdout.count("ACCEPTED") == 2 and proc.stdout.count("REFUSED") == 2, proc.stdout
    assert "OTHER" not in proc.stdout, proc.stdout


def test_expert_parallel_steps_match_single_rank(layout, tmp_path):
    """Qwen3-MoE with its experts split over EP=2 (each rank holds 4 of 8, the dense layers
    data-parallel): the EP ranks run the same micro-batches in lockstep, padded to one shape for
    the allgather dispatcher; expert gradients are reduced over the expert-data-parallel group and
    counted once per EP rank in the norm. Two steps reproduce one rank's (without the load-balancing
    loss, whose per-micro-batch sums depend on the packing: tests/unit/test_moe.py weighs it)."""
    model_dir = make_random_qwen3_moe(tmp_path / "qwen3_moe", seed=11)
    out = tmp_path / "ep2.json"
    run_torchrun(2, ["tests/dist/trainer_tp.py", str(model_dir), str(out), "ep"], timeout=300)
    assert_same_steps(two_steps(Trainer(TrainerConfig(**EP_STEP_CONFIG), model_dir, layout)), json.loads(out.read_text()))
