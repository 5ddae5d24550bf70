"""Faults around the run's files, in one process: a torn last line of ``metrics.jsonl`` /
``ledger.jsonl`` is dropped on resume and logged; truncated or mis-shaped weights in ``model.path`` are
refused at preflight naming the file / tensor. Damaged checkpoints over a real gloo group, a full disk
and the program end to end: tests/integration/test_checkpoint_faults_procs.py.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from rollpacker.checkpoint import FileFault
from rollpacker.configlib import ConfigError
from rollpacker.metrics import MetricsLogger
from rollpacker.runtime.ledger import PromptLedger
from rollpacker.runtime.preflight import check_weights, preflight
from testkit import REPO_ROOT

POLICY = REPO_ROOT / "assets" / "policy"


def _damage(file: Path, how: str) -> None:
    data = bytearray(file.read_bytes())
    if how == "truncate":
        del data[len(data) // 2:]
    else:  # same size, one byte changed: only the checksum can tell
        data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


# --- torn record lines ---------------------------------------------------------------------------------
def test_a_torn_last_line_of_metrics_and_ledger_is_dropped_on_resume(tmp_path, caplog):
    metrics = MetricsLogger(tmp_path, rank=0, wandb_mode="disabled", project="p", name="n")
    ledger = PromptLedger(tmp_path, resume_step=0)
    for step in (1, 2, 3):
        metrics.log(step, {"loss": 0.5})
        ledger.record(step, [], [])
    for name in ("metrics.jsonl", "ledger.jsonl"):
        with (tmp_path / name).open("a") as f:
            f.write('{"step": 4, "lo')  # a kill (or a full disk) mid-line
    with caplog.at_level(logging.WARNING, logger="rollpacker.checkpoint"):
        MetricsLogger(tmp_path, rank=0, wandb_mode="disabled", project="p", name="n", resume_step=2)
        PromptLedger(tmp_path, resume_step=2)
    print(caplog.text)
    for name in ("metrics.jsonl", "ledger.jsonl"):
        assert [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()] == [1, 2]
        assert f"{tmp_path / name}: dropped a torn last line (line 4, 15 bytes" in caplog.text

    # damage anywhere but the last line is not a torn write: refused, naming the line
    (tmp_path / "ledger.jsonl").write_text('{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(FileFault, match=r"ledger.jsonl: line 2 is not JSON"):
        PromptLedger(tmp_path, resume_step=2)


# --- broken weights at preflight -------------------------------------------------------------------------
def _preflight_refusal(tmp_path: Path, model: Path, capsys, monkeypatch) -> str:
    """preflight() as rank 0 of the shipped 2-rank config sees it, with ``model`` as model.path."""
    monkeypatch.chdir(REPO_ROOT)
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as stopped:
        preflight(["--config", str(REPO_ROOT / "configs" / "tiny-cpu.yaml"), f"model.path={model}",
                   f"run.output_dir={tmp_path}"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    print(err)
    assert err.count("rollpacker: cannot start:") == 1
    return err


def test_truncated_weights_are_refused_at_preflight_naming_the_file(tmp_path, capsys, monkeypatch):
    model = Path(shutil.copytree(POLICY, tmp_path / "policy"))
    _damage(model / "model.safetensors", "truncate")
    err = _preflight_refusal(tmp_path, model, capsys, monkeypatch)
    assert f"model.path: {model / 'model.safetensors'} is not a readable safetensors file" in err
    assert "incomplete metadata" in err


def test_weights_of_another_shape_are_refused_at_preflight_naming_the_tensor(tmp_path, capsys, monkeypatch):
    model = Path(shutil.copytree(POLICY, tmp_path / "policy"))
    config = json.loads((model / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(num_hidden_layers=layers + 1, layer_types=config["layer_types"] + ["full_attention"])
    (model / "config.json").write_text(json.dumps(config))
    err = _preflight_refusal(tmp_path, model, capsys, monkeypatch)
    assert f"no safetensors file in {model} holds model.layers.{layers}.input_layernorm.weight (and 11 more)" in err
    config.update(num_hidden_layers=layers, layer_types=config["layer_types"][:layers],
                  intermediate_size=2 * config["intermediate_size"])
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has "
                                          rf"shape \[{config['intermediate_size'] // 2}, "):
        check_weights(model, "model.path")
