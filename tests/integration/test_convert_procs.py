"""HF <-> Megatron conversion over 2 torchrun ranks: the CLI's parity check at TP=2 and bit-identical round
trips at TP=2 and PP=2, on Qwen2 and Qwen3, tied and untied. The one-process checks:
tests/unit/test_convert.py."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from testkit import make_random_qwen3_moe, run_torchrun
from tests.dist.megatron_fixtures import ckpts  # noqa: F401  (pytest fixture)
from tests.unit.test_convert import assert_same_checkpoint
from tests.unit.test_megatron_model import LOGPROB_GRAD_TOL

# TP=2 splits the vocab-parallel log-softmax and the row-parallel matmuls into partial sums reduced
# across ranks: another summation order, one more rounding. 10x the measured max differences (README:
# |dlogp| 9.5e-7 at TP=2; |dH| 1.9e-6).
TP2_LOGPROB_TOL, TP2_ENTROPY_TOL = 1e-5, 2e-5


# (tied checkpoint, untied checkpoint) per family
FAMILY_PAIRS = {"qwen2": ("tied", "untied"), "qwen3": ("qwen3_tied", "qwen3")}


@pytest.mark.parametrize("family", sorted(FAMILY_PAIRS))
def test_under_torchrun_tp2_parity_cli_and_tp2_pp2_round_trips(ckpts, tmp_path, family):
    tied, untied = FAMILY_PAIRS[family]
    proc = run_torchrun(2, ["tests/dist/megatron_convert_checks.py", str(ckpts[tied]), str(ckpts[untied]),
                            str(tmp_path)], timeout=400)
    cli_line = next(line for line in proc.stdout.splitlines() if "max |dlogp|" in line)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(cli_line, result, sep="\n")
    assert "tp=2" in cli_line and cli_line.rstrip().endswith("PASS") and result["cli_exit_code"] == 0
    assert float(re.search(r"max \|dlogp\| = (\S+)", cli_line).group(1)) < TP2_LOGPROB_TOL
    assert float(re.search(r"max \|dH\| = (\S+)", cli_line).group(1)) < TP2_ENTROPY_TOL
    assert result["logprob_diff"] < TP2_LOGPROB_TOL and result["entropy_diff"] < TP2_ENTROPY_TOL
    assert all(result[name] < bound for name, bound in LOGPROB_GRAD_TOL.items())
    for sizes in ("tp2", "pp2"):
        for kind, name in zip((tied, untied), ("tied", "untied")):
            assert_same_checkpoint(ckpts[kind], tmp_path / f"{sizes}_{name}")
    # Tied embeddings under PP: the last stage holds its own output copy, loaded from the HF embedding.
    last_stage = torch.load(tmp_path / "mcore_pp2_tied" / "mp_rank_00_001" / "model.pt", weights_only=True)["model"]
    embedding = load_file(str(ckpts[tied] / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(last_stage["output_layer.weight"][:250], embedding)
    assert not last_stage["output_layer.weight"][250:].any()


def test_qwen3_moe_parity_at_ep2_and_tp2_and_round_trips(tmp_path):
    """A random Qwen3-MoE (8 experts, top-2, 4 layers of which the second dense): log-probs against transformers at
    EP=2 (each rank holds 4 experts; tokens reach them through the allgather dispatcher) and TP=2
    (experts split as dense MLPs); the weight sync's export at EP=2 gathers every expert bit for bit;
    HF -> mcore -> HF at TP=2 and PP=2 gives back the same checkpoint."""
    hf_dir = make_random_qwen3_moe(tmp_path / "hf", seed=3, num_hidden_layers=4)
    proc = run_torchrun(2, ["tests/dist/moe_checks.py", str(hf_dir), str(tmp_path)], timeout=400)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(result)
    assert result["ep2_logprob_diff"] < TP2_LOGPROB_TOL and result["ep2_entropy_diff"] < TP2_ENTROPY_TOL
    assert result["tp2_logprob_diff"] < TP2_LOGPROB_TOL and result["tp2_entropy_diff"] < TP2_ENTROPY_TOL
    assert result["ep2_local_expert_params"] == 3 * 2 * 4  # 3 sparse layers x (fc1, fc2) x 4 local experts
    assert result["ep2_export_names_equal"] and result["ep2_export_max_diff"] == 0.0
    for sizes in ("tp2", "pp2"):
        assert_same_checkpoint(hf_dir, tmp_path / sizes)
