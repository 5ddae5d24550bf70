"""Faults around the run's files end in a safe fallback or one clear message, never a crash loop.
(A torn last record line, and broken weights at preflight, in one process: tests/unit/test_checkpoint_faults.py.)

- A damaged shard of the latest checkpoint (truncated, or bytes flipped): every rank agrees, over a
  real gloo group, to resume from the previous one, and the skipped file is named with its expected
  and found size/checksum; with every checkpoint damaged, one refusal naming the files;
  ``run.resume_from`` pins one (refused when absent or damaged).
- A full disk (a tmpfs of the test's own; mounting needs root, which CI has): refused before writing
  when the last checkpoint's size does not fit, cleaned up when a write fails part-way, a record line
  that does not fit is taken back; the previous checkpoints stay intact.
- The program end to end on a small filesystem: the clear stop at the checkpoint that does not fit;
  then, space freed, a damaged shard of rank 1 in the latest checkpoint and torn records, the same
  command resumes from the checkpoint before it with the prompt ledger exact.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollpacker.checkpoint import CheckpointManager, FileFault, append_record, digest
from rollpacker.runtime.ledger import PromptLedger
from tests.unit.test_checkpoint_faults import _damage

sys.path.insert(0, str(Path(__file__).parent))
from test_resume_shipped import assert_no_prompt_lost_or_repeated  # noqa: E402
from test_train_program import _train  # noqa: E402


# --- two ranks over a real gloo group ------------------------------------------------------------------
# name -> (files damaged after steps 1 and 2 are saved: (step, file, how), run.resume_from)
SCENARIOS = {
    "truncate": ([(2, "rank00001.pt", "truncate")], None),
    "flip": ([(2, "rank00001.pt", "flip")], None),
    "all_damaged": ([(1, "shared.pt", "flip"), (2, "rank00001.pt", "truncate")], None),
    "pinned": ([], 1),
    "pinned_absent": ([], 5),
    "pinned_damaged": ([(1, "rank00000.pt", "flip")], 1),
}


def _resume_on_rank(rank: int, tmp: Path) -> None:
    """For each scenario: both ranks save steps 1 and 2, rank 0 damages files, both resume; the
    outcomes go to a file per rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=2)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("rollpacker.checkpoint").addHandler(handler)
    outcomes = {}
    for name, (damage, pinned) in SCENARIOS.items():
        warnings.clear()
        ckpt = CheckpointManager(tmp / name, keep=3)
        for step in (1, 2):
            ckpt.save(step, {"step": step, "w": torch.full((20_000,), 10.0 * step + rank)}, {"step": step})
        if rank == 0:
            for step, file, how in damage:
                _damage(ckpt.path(step) / file, how)
        dist.barrier()
        try:
            step = ckpt.resume_step(pinned)
            state, shared = ckpt.load(step)
            outcome = {"step": step, "loaded": [state["step"], float(state["w"][0])], "shared": shared}
        except FileFault as exc:
            outcome = {"fault": str(exc)}
        outcomes[name] = {**outcome, "warnings": list(warnings), "left": ckpt.steps()}
    (tmp / f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """Every scenario's outcome on rank 0 and rank 1 (one pair of processes for all: they are cheap
    to run, not to start)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(_resume_on_rank, args=(tmp,), nprocs=2)
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    return tmp, {name: [ranks[0][name], ranks[1][name]] for name in SCENARIOS}


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_a_damaged_shard_of_the_latest_checkpoint_is_skipped_on_every_rank(two_ranks, how):
    tmp, outcomes = two_ranks
    ranks = outcomes[how]
    print(json.dumps(ranks, indent=1))
    # rank 0's own files are intact, yet it resumes from step 1 too: the ranks agreed before loading
    assert [r["step"] for r in ranks] == [1, 1]
    assert ranks[0]["loaded"] == [1, 10.0] and ranks[1]["loaded"] == [1, 11.0] and ranks[0]["shared"] == {"step": 1}
    skipped = [w for w in ranks[0]["warnings"] if "checkpoint step 2 is damaged, skipped" in w]
    assert len(skipped) == 1, ranks[0]["warnings"]
    # step 1's rank-1 file has the size step 2's had (the same state but for the step number)
    step1 = json.loads((tmp / how / "checkpoints" / "step_00000001" / "COMPLETE").read_text())
    size = step1["files"]["rank00001.pt"]["size"]
    found = f"found {size // 2:,} bytes" if how == "truncate" else f"found {size:,} bytes xxh3 "
    assert f"step_00000002/rank00001.pt: expected {size:,} bytes xxh3 " in skipped[0] and found in skipped[0]
    # the damaged step is redone by this run: its directory goes, so no later restart can pick it
    assert ranks[0]["left"] == ranks[1]["left"] == [1]


def test_every_checkpoint_damaged_is_one_clear_refusal(two_ranks):
    tmp, outcomes = two_ranks
    ranks = outcomes["all_damaged"]
    print(ranks[0]["fault"])
    assert ranks[0]["fault"] == ranks[1]["fault"]
    fault = ranks[0]["fault"]
    assert fault.startswith(f"no intact checkpoint in {tmp / 'all_damaged' / 'checkpoints'}")
    assert "step_00000002/rank00001.pt: expected" in fault and "step_00000001/shared.pt: expected" in fault
    assert ranks[0]["left"] == [1, 2]  # nothing is removed when nothing can be resumed


def test_resume_from_pins_a_checkpoint_and_is_refused_when_absent_or_damaged(two_ranks):
    _, outcomes = two_ranks
    pinned, absent, damaged = (outcomes[n] for n in ("pinned", "pinned_absent", "pinned_damaged"))
    print(absent[0]["fault"], damaged[0]["fault"], sep="\n")
    assert [r["step"] for r in pinned] == [1, 1] and pinned[1]["loaded"] == [1, 11.0]
    assert pinned[0]["left"] == pinned[1]["left"] == [1]  # step 2 is redone
    assert absent[0]["fault"] == absent[1]["fault"]
    assert "run.resume_from=5" in absent[0]["fault"] and "(complete: 1, 2)" in absent[0]["fault"]
    assert damaged[1]["fault"].startswith("run.resume_from=1: checkpoint step 1 is damaged")
    assert "step_00000001/rank00000.pt" in damaged[1]["fault"] and damaged[0]["left"] == [1, 2]


# --- a full disk -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _tmpfs(path: Path, size: int):
    """A tmpfs of ``size`` bytes at ``path`` for the block, unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for run.output_dir needs root (CI runs as root)")
    path.mkdir(parents=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _resize(path: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def _intact(ckpt: CheckpointManager, step: int) -> bool:
    files = json.loads((ckpt.path(step) / "COMPLETE").read_text())["files"]
    return all(digest(ckpt.path(step) / name) == entry for name, entry in files.items())


def test_a_full_disk_stops_the_checkpoint_and_keeps_the_previous_one(tmp_path):
    with _tmpfs(tmp_path / "fs", 1 << 20) as fs:
        ckpt = CheckpointManager(fs / "run", keep=1)
        state = {"w": torch.zeros(100_000)}  # 400 kB: two fit in 1 MiB, three do not
        ckpt.save(1, state)
        ckpt.save(2, state)  # step 1 is pruned after step 2 is complete
        size = sum(f["size"] for f in json.loads((ckpt.path(2) / "COMPLETE").read_text())["files"].values())

        # space for the rank file, none for the export: the write fails part-way
        def export(d: Path) -> None:
            (d / "big.bin").write_bytes(b"x" * 500_000)
        with pytest.raises(FileFault) as failed:
            ckpt.save(3, state, export=export)
        message = str(failed.value)
        print(message)
        assert message.startswith(f"checkpoint step 3 not written to {ckpt.root}: rank 0: [Errno 28] No space left")
        assert f"needs about {size:,} bytes (the size of step 2's checkpoint)" in message
        assert "bytes are free there now" in message and "checkpoints kept: 2" in message
        assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_00000002"] and _intact(ckpt, 2)

        # the last checkpoint's size does not fit: refused before anything is written
        (fs / "filler").write_bytes(b"x" * 300_000)
        free = shutil.disk_usage(fs).free
        with pytest.raises(FileFault) as refused:
            ckpt.save(3, state)
        print(refused.value)
        assert "rank 0: [Errno 28] No space left on device: refused before writing" in str(refused.value)
        assert f"; {free:,} bytes are free there now" in str(refused.value)
        assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_00000002"] and _intact(ckpt, 2)

        # space freed: the same save goes through, and a resume picks it
        _resize(fs, 4 << 20)
        ckpt.save(3, state, export=export)
        assert ckpt.steps() == [3] and _intact(ckpt, 3) and ckpt.resume_step() == 3


def test_a_record_line_that_does_not_fit_is_taken_back(tmp_path):
    with _tmpfs(tmp_path / "fs", 64 << 10) as fs:
        ledger = PromptLedger(fs, resume_step=0)
        ledger.record(1, [], [])
        before = ledger.path.read_bytes()
        with pytest.raises(OSError) as full:
            append_record(ledger.path, {"step": 2, "blob": "x" * (128 << 10)})
        print(full.value)
        assert full.value.errno == 28 and str(ledger.path) in str(full.value)
        assert f"appending a {len(json.dumps({'step': 2, 'blob': 'x' * (128 << 10)})) + 1:,}-byte line" in str(full.value)
        assert ledger.path.read_bytes() == before  # no torn line left behind


# --- the program, end to end -----------------------------------------------------------------------------
def test_the_program_stops_on_a_full_disk_then_resumes_past_a_damaged_shard(tmp_path):
    # a tiny-cpu checkpoint is about 19.4 MB: two fit in 48 MiB with the run's other files, a third does not
    with _tmpfs(tmp_path / "fs", 48 << 20) as fs:
        run_dir = fs / "runs" / "faults"
        steps = ["run.steps=3", "run.save_every=1", "run.wandb=disabled"]
        ckpt = CheckpointManager(run_dir)

        full = _train(run_dir, *steps, check=False)
        stopped = [ln for ln in full.stderr.splitlines() if "rollpacker: stopped:" in ln]
        print(stopped)
        assert full.returncode != 0 and len(stopped) == 1, full.stderr[-4000:]
        assert f"checkpoint step 3 not written to {ckpt.root}: rank 0: [Errno 28] No space left" in stopped[0]
        assert "(the size of step 2's checkpoint)" in stopped[0] and "checkpoints kept: 1, 2" in stopped[0]
        # no rank raised (torchrun's summary has no error file of a worker's exception); the one traceback
        # is torchrun's own, as for any worker that exits non-zero
        assert full.stderr.count("error_file: <N/A>") == 2 and full.stderr.count("Traceback") == 1
        assert sorted(p.name for p in ckpt.root.iterdir()) == ["step_00000001", "step_00000002"]
        assert _intact(ckpt, 1) and _intact(ckpt, 2)

        # space freed; meanwhile rank 1's shard of the latest checkpoint was cut short after COMPLETE,
        # and a kill tore the last line of both records: the same command resumes from step 1
        _resize(fs, 128 << 20)
        shard = ckpt.path(2) / "rank00001.pt"
        _damage(shard, "truncate")
        for name in ("metrics.jsonl", "ledger.jsonl"):
            with (run_dir / name).open("a") as f:
                f.write('{"step": 3, "tr')
        resumed = _train(run_dir, *steps)
        skipped = [ln for ln in resumed.stderr.splitlines() if "checkpoint step 2 is damaged, skipped" in ln]
        print(skipped)
        assert len(skipped) == 1 and f"{shard}: expected " in skipped[0] and "resumed from step 1 " in resumed.stderr
        for name in ("metrics.jsonl", "ledger.jsonl"):
            assert f"{run_dir / name}: dropped a torn last line" in resumed.stderr
        assert ckpt.steps() == [2, 3]
        assert_no_prompt_lost_or_repeated(run_dir, steps=3)
        assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
