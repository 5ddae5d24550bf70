"""Config loading: every refusal names the key and the file, and says how to fix it."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollpacker.config import check_layout, load_config
from rollpacker.configlib import ConfigError
from testkit import REPO_ROOT, make_random_qwen2

CONFIGS = REPO_ROOT / "configs"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # 4 attention heads, 2 KV heads
    return make_random_qwen2(tmp_path_factory.mktemp("model"))


def _cfg(model_dir: Path, *overrides: str):
    return load_config(CONFIGS / "tiny-cpu.yaml", [f"model.path={model_dir}", *overrides])


@pytest.mark.parametrize("name,tp,pp,cp,rollout_tp,max_len,world", [
    ("qwen2.5-7b", 2, 1, 1, 1, 8192, 16),
    ("qwen2.5-14b", 2, 2, 2, 2, 16384, 32),
    ("qwen2.5-32b", 4, 1, 4, 4, 32768, 64),
])
def test_published_configs(name, tp, pp, cp, rollout_tp, max_len, world):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert (cfg.trainer.tp, cfg.trainer.pp, cfg.trainer.cp) == (tp, pp, cp)
    assert (cfg.scheduler.p0, cfg.scheduler.r0, cfg.scheduler.eta_p, cfg.scheduler.eta_r) == (128, 8, 1.25, 1.25)
    assert cfg.rollout.tp == rollout_tp and cfg.rollout.max_response_length == max_len
    assert cfg.rollout.backend == "sglang"
    check_layout(cfg, world, require_files=False)


def test_overrides_are_typed(model_dir):
    cfg = _cfg(model_dir, "trainer.lr=3e-5", "scheduler.planner.enabled=false", "data.train_files=[a.jsonl, b.jsonl]")
    assert cfg.trainer.lr == 3e-5 and isinstance(cfg.trainer.lr, float)
    assert cfg.scheduler.planner.enabled is False
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]


def test_unknown_key_suggests_closest(model_dir):
    with pytest.raises(ConfigError) as err:
        _cfg(model_dir, "trainer.lrr=1e-5")
    msg = str(err.value)
    assert "trainer.lrr" in msg and "'trainer.lr'" in msg and "tiny-cpu.yaml" in msg


def test_unknown_section_suggests_closest(model_dir):
    with pytest.raises(ConfigError, match=r"unknown key 'schedulr'.*'scheduler'"):
        _cfg(model_dir, "schedulr.p0=4")


def test_wrong_type_names_key(model_dir):
    with pytest.raises(ConfigError, match=r"tiny-cpu.yaml: scheduler.p0 must be int, got str 'many'"):
        _cfg(model_dir, "scheduler.p0=many")
    with pytest.raises(ConfigError, match=r"rollout.backend must be one of \['reference', 'sglang'\]"):
        _cfg(model_dir, "rollout.backend=vllm")


def test_section_validation_names_key(model_dir):
    with pytest.raises(ConfigError, match=r"tiny-cpu.yaml: scheduler.eta_p must be >= 1.0"):
        _cfg(model_dir, "scheduler.eta_p=0.5")


def test_layout_not_dividing_world(model_dir):
    cfg = _cfg(model_dir, "trainer.tp=2", "trainer.pp=2")
    with pytest.raises(ConfigError, match=r"trainer.tp\*trainer.pp\*trainer.cp = 2\*2\*1 = 4 does not divide the world size 2"):
        check_layout(cfg, 2)


def test_heads_not_divisible_by_tp(model_dir):
    cfg = _cfg(model_dir, "trainer.tp=4", "scheduler.planner.enabled=false")
    with pytest.raises(ConfigError, match=r"trainer.tp=4 does not divide the model's attention heads \(4\) and KV heads \(2\)"):
        check_layout(cfg, 4)


def test_verify_sync_is_refused_with_an_engine_that_cannot_read_weights_back(model_dir):
    cfg = _cfg(model_dir, "run.verify_sync=true", "rollout.backend=sglang")
    with pytest.raises(ConfigError, match=r"run.verify_sync=true needs an engine that can read its weights back"):
        check_layout(cfg, 2)


def test_sglang_deterministic_inference_is_refused_on_cpu_before_any_engine_starts(model_dir, monkeypatch):
    """sglang refuses --enable-deterministic-inference with the torch_native attention a CPU engine runs
    (measured with 0.5.23: at engine start, on every rank); the preflight says so first."""
    import importlib.util

    from rollpacker.runtime import preflight
    real = importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real(name, *a))
    preflight.check_backends(_cfg(model_dir, "rollout.backend=sglang"))  # installed, and nothing else asked
    cfg = _cfg(model_dir, "rollout.backend=sglang", "rollout.sglang_deterministic_inference=true")
    with pytest.raises(ConfigError, match=r"sglang_deterministic_inference=true needs one of sglang's GPU attention"):
        preflight.check_backends(cfg)


def test_batch_not_divisible_by_dp(model_dir):
    cfg = _cfg(model_dir, "scheduler.p0=3", "scheduler.r0=3")
    with pytest.raises(ConfigError, match=r"scheduler.p0\*scheduler.r0 = 9 is not divisible by the data-parallel size 2"):
        check_layout(cfg, 2)


def test_missing_model_dir(tmp_path):
    cfg = _cfg(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"model.path: .*nowhere has no config.json"):
        check_layout(cfg, 2)


def test_valid_tiny_layout(model_dir):
    check_layout(_cfg(model_dir), 2, require_files=False)


def test_base_file_is_read_first_and_overridden_section_by_section(tmp_path):
    recheck = load_config(CONFIGS / "tiny-cpu-recheck.yaml")
    tiny = load_config(CONFIGS / "tiny-cpu.yaml")
    assert (recheck.model.path, recheck.rollout.max_response_length) == ("assets/policy-recheck", 896)
    assert recheck.data.train_files == ["assets/data-recheck/train.jsonl"]
    # every key the variant does not set is tiny-cpu.yaml's, nested sections included
    assert recheck.scheduler == tiny.scheduler and recheck.trainer == tiny.trainer
    assert (recheck.rollout.temperature, recheck.run.eval) == (tiny.rollout.temperature, tiny.run.eval)
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"a.yaml: its base chain comes back to it: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing.yaml does not exist \(the base of .*c.yaml\)"):
        load_config(tmp_path / "c.yaml")


def test_the_race_resolves_per_backend_and_refuses_what_it_cannot_run(model_dir):
    tiny, gpu = _cfg(model_dir), load_config(CONFIGS / "qwen2.5-7b.yaml")
    assert tiny.rollout.seeded and tiny.scheduler.races_by_length(tiny.rollout.seeded)  # auto: the reference engine
    assert not gpu.rollout.seeded and not gpu.scheduler.races_by_length(gpu.rollout.seeded)  # auto: unseeded SGLang
    gpu.rollout.sglang_deterministic_inference = True  # sglang's sampler reads the seed: reproducible lengths
    assert gpu.rollout.seeded and gpu.scheduler.races_by_length(gpu.rollout.seeded)
    assert not tiny.scheduler.races_by_length(True, virtual_clock=True)  # the simulator: reproducible already
    check_layout(_cfg(model_dir, "scheduler.race=deterministic", "rollout.backend=sglang"), 2)  # SGLang streams progress
    with pytest.raises(ConfigError, match="race=deterministic does not run dynamic_sampling"):
        _cfg(model_dir, "scheduler.race=deterministic", "scheduler.mode=dynamic_sampling")
