"""A job of several nodes, its shape at preflight: TP sizes that do not fit in a node are capped (the
planner's) or refused with a fix that works (the sizes a config fixes); a shape that fits is left alone.
The runs on nodes emulated on this machine: tests/integration/test_multinode_procs.py.
"""
from __future__ import annotations

import re

import pytest

from rollpacker.config import check_layout, load_config
from rollpacker.configlib import ConfigError, to_dict
from rollpacker.runtime.preflight import fit_to_nodes, preflight
from testkit import REPO_ROOT

POLICY = REPO_ROOT / "assets" / "policy"
pytestmark = pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="shipped policy missing")

TINY = REPO_ROOT / "configs" / "tiny-cpu.yaml"


def _tiny(*overrides: str):
    return load_config(TINY, list(overrides)).resolve(REPO_ROOT)


def test_planner_tps_beyond_a_node_are_capped_with_one_line():
    cfg = _tiny()  # planner: short_tp 1, long_tp 2, max_tp 2, profile rows of TP 1 and 2
    line = fit_to_nodes(cfg, world_size=2, ranks_per_node=1)  # 2 nodes x 1 rank
    print(line)
    assert line.startswith("scheduler.planner capped to TP 1 (max_tp 2->1, long_tp 2->1, profile rows of TP [2] "
                           "dropped)") and "LOCAL_WORLD_SIZE" in line
    p = cfg.scheduler.planner
    assert (p.max_tp, p.short_tp, p.long_tp, [r.tp for r in p.profile]) == (1, 1, 1, [1])
    assert p.tp_choices(2, cfg.rollout.tp) == [1]
    # 2 nodes x 6 ranks: TP 4 and 8 would span nodes (4 does not divide 6); capped to 2
    cfg = _tiny("scheduler.planner.max_tp=8", "scheduler.planner.profile=[]")
    assert fit_to_nodes(cfg, 12, 6).startswith("scheduler.planner capped to TP 2 (max_tp 8->2)")
    assert cfg.scheduler.planner.tp_choices(12, 1) == [1, 2]


@pytest.mark.parametrize("world, per_node", [(4, 2), (2, 2), (16, 8)])
def test_a_shape_that_fits_is_left_alone(world, per_node):
    """2 nodes x 2 ranks (the multi-node run of tests/integration/test_multinode_procs.py), one node, and
    2 x 8 with max_tp 8: no line, no change."""
    cfg = _tiny("scheduler.planner.max_tp=8") if per_node == 8 else _tiny()
    before = to_dict(cfg)
    assert fit_to_nodes(cfg, world, per_node) is None
    assert to_dict(cfg) == before


@pytest.mark.parametrize("overrides, world, per_node, message", [
    (["trainer.tp=2"], 2, 1, "trainer.tp=2 does not fit"),
    (["rollout.tp=2"], 2, 1, "rollout.tp=2 does not fit"),
    (["scheduler.planner.min_tp=2", "scheduler.planner.short_tp=2", "rollout.tp=2"], 2, 1,
     "scheduler.planner.min_tp=2 does not fit"),
])
def test_fixed_sizes_beyond_a_node_are_refused_with_a_fix_that_works(overrides, world, per_node, message):
    cfg = _tiny(*overrides)
    check_layout(cfg, world)  # the world size alone would take them
    with pytest.raises(ConfigError) as refused:
        fit_to_nodes(cfg, world, per_node)
    text = str(refused.value)
    print(text)
    assert message in text and f"a node has {per_node} rank(s)" in text and "LOCAL_WORLD_SIZE" in text
    fix = re.search(r"; set (\S+=\d+)", text)
    if fix:  # the key it names, set as it says, passes
        fixed = _tiny(*overrides, fix.group(1))
        check_layout(fixed, world)
        fit_to_nodes(fixed, world, per_node)
    else:  # min_tp: more ranks per node, as it says
        assert "run a multiple of 2 ranks per node" in text
        fit_to_nodes(_tiny(*overrides), world, 2)


def test_preflight_logs_the_cap_once_and_refuses_on_every_rank(tmp_path, monkeypatch, capsys):
    one_row = tmp_path / "train.jsonl"
    one_row.write_text((REPO_ROOT / "assets" / "data" / "train.jsonl").read_text().splitlines()[0] + "\n")
    argv = ["--config", str(TINY), f"data.train_files=[{one_row}]", "data.eval_files=[]", f"run.output_dir={tmp_path}"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        pre = preflight(argv)
        assert pre.cfg.scheduler.planner.long_tp == 1
        err = capsys.readouterr().err
        assert err.count("rollpacker: scheduler.planner capped to TP 1") == lines, err
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        preflight([*argv, "trainer.tp=2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "cannot start" in err and "trainer.tp=2 does not fit" in err
