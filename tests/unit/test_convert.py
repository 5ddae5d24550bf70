"""HF <-> Megatron conversion: bit-identical round trips at TP=1 (sharding at TP=2 and 4 in one process),
and the conversion CLI. TP=2 parity and the TP=2 / PP=2 round trips under torchrun:
tests/integration/test_convert_procs.py.

Every check runs on Qwen2 (QKV bias) and Qwen3 (q/k norms, head_dim != hidden / heads), tied and untied."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from megatron_ext import weights
from megatron_ext.convert import main
from megatron_ext.model import build_model, padded_vocab_size
from rollpacker.hf_spec import parse_spec
from megatron_ext.weights import iter_hf_tensors, load_hf_checkpoint, save_hf_checkpoint
from tests.dist.megatron_fixtures import ckpts, layout  # noqa: F401  (pytest fixtures)
from tests.unit.test_megatron_model import PARITY_ENTROPY_TOL, PARITY_LOGPROB_TOL

def assert_same_checkpoint(expected_dir, actual_dir):
    expected, actual = (load_file(str(d / "model.safetensors")) for d in (expected_dir, actual_dir))
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        got = actual[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), f"{name} differs after the round trip"
    assert json.loads((actual_dir / "config.json").read_text()) == json.loads((expected_dir / "config.json").read_text())
    assert (actual_dir / "generation_config.json").is_file()  # non-weight files travel along


@pytest.mark.parametrize("kind", ["tied", "untied", "qwen3", "qwen3_tied"])
def test_hf_megatron_hf_round_trip_is_bit_identical(ckpts, layout, tmp_path, kind):
    model = build_model(ckpts[kind], pg_collection=layout.pg_collection)
    load_hf_checkpoint(model, ckpts[kind])
    save_hf_checkpoint(model, layout, tmp_path, ckpts[kind])
    assert_same_checkpoint(ckpts[kind], tmp_path)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["untied", "qwen3"])
def test_sharding_is_inverted_by_gathering_at_any_tp(ckpts, tp, kind):
    # 8 heads in 4 KV groups: at TP=4 each rank holds one group of two query heads.
    cfg = {**json.loads((ckpts[kind] / "config.json").read_text()),
           "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64}
    spec = parse_spec(cfg)
    shapes = spec.hf_shapes()
    full = {name: torch.randn(shape) for name, shape in shapes.items() if name.startswith(("model.layers.0.", "lm_head"))}
    groups = [("lm_head.weight",), ("model.layers.0.self_attn.o_proj.weight",),
              tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"),
              ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")]
    kinds = [weights._Kind.VOCAB, weights._Kind.ROW, weights._Kind.QKV, weights._Kind.FC1]
    if spec.qkv_bias:
        groups.append(tuple(f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"))
        kinds.append(weights._Kind.QKV)
    for names, kind in zip(groups, kinds):
        rows = {weights._Kind.VOCAB: padded_vocab_size(spec, tp) // tp,
                weights._Kind.ROW: shapes[names[0]][0],
                weights._Kind.QKV: sum(shapes[n][0] for n in names) // tp,
                weights._Kind.FC1: 2 * shapes[names[0]][0] // tp}[kind]
        trailing = shapes[names[0]][1:]
        if kind is weights._Kind.ROW:
            trailing = (trailing[0] // tp,)
        binding = weights._Binding(torch.empty(rows, *trailing), kind, names)
        shards = [weights._shard(binding, [full[n] for n in names], spec, r, tp) for r in range(tp)]
        assert all(s.shape == binding.param.shape for s in shards), names
        for name, tensor in zip(names, weights._unshard(binding, shards, spec)):
            assert torch.equal(tensor, full[name]), (name, tp)


@pytest.mark.parametrize("kind", ["untied", "qwen3"])
def test_iter_hf_tensors_yields_every_tensor_once_in_the_documented_order(ckpts, layout, kind):
    model = build_model(ckpts[kind], pg_collection=layout.pg_collection)
    load_hf_checkpoint(model, ckpts[kind])
    yielded = [(name, tuple(t.shape)) for name, t in iter_hf_tensors(model, layout)]
    assert yielded == list(parse_spec(ckpts[kind]).hf_shapes().items())
    # Exported tensors are copies: changing one must not touch the model.
    name, norm = next((n, t) for n, t in iter_hf_tensors(model, layout) if n.endswith("input_layernorm.weight"))
    norm.zero_()
    assert model.decoder.layers[0].input_layernorm.weight.abs().sum() > 0


@pytest.mark.parametrize("built, loaded", [("tied", "untied"), ("untied", "qwen3")])
def test_loading_a_checkpoint_of_another_architecture_is_refused(ckpts, layout, built, loaded):
    model = build_model(ckpts[built], pg_collection=layout.pg_collection)
    with pytest.raises(ValueError, match="config.json describes .* but the model was built for"):
        load_hf_checkpoint(model, ckpts[loaded])


@pytest.mark.parametrize("kind", ["untied", "qwen3"])
def test_cli_mcore_round_trip(ckpts, tmp_path, kind):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", str(ckpts[kind]), str(mcore)]) == 0
    assert json.loads((mcore / "mcore.json").read_text()) == {"format": 1, "tp": 1, "pp": 1, "dtype": "fp32"}
    assert (mcore / "mp_rank_00_000" / "model.pt").is_file()
    assert main(["mcore-to-hf", str(mcore), str(back)]) == 0
    assert_same_checkpoint(ckpts[kind], back)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_tied"])
def test_cli_verify_passes_on_qwen3_at_tp1(ckpts, capsys, kind):
    assert main(["--verify", str(ckpts[kind])]) == 0
    line = capsys.readouterr().out.rstrip()
    print(line)
    assert line.endswith("PASS") and "tp=1" in line
    assert float(re.search(r"max \|dlogp\| = (\S+)", line).group(1)) < PARITY_LOGPROB_TOL
    assert float(re.search(r"max \|dH\| = (\S+)", line).group(1)) < PARITY_ENTROPY_TOL


def test_cli_verify_fails_with_exit_code_1(ckpts, capsys):
    # PASS is checked under torchrun (tests/integration/test_convert_procs.py); no real difference is
    # below a tolerance of 0.
    assert main(["--verify", str(ckpts["tied"]), "--tol", "0"]) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL")
