"""Atomic, self-checking, resumable checkpoints for the SPMD job, and the run's append-only records.

Layout of one checkpoint::

    RUN_DIR/checkpoints/step_00000010/
        rank00000.pt ... rankNNNNN.pt    each rank's own state (trainer shards, RNG)
        shared.pt                        rank 0's coordinator state (data cursor,
                                         long-prompt queue, planner, reward timeouts)
        hf/                              the policy as an HF directory, for evaluation
        COMPLETE                         written last: the manifest, every file's size and
                                         xxh3-64; a directory without it is ignored

Every rank writes into ``step_XXXXXXXX.tmp``; once every file is written each rank digests its own
file, rank 0 the rest, and rank 0 writes ``COMPLETE`` and renames the directory into place, so a
crash at any point leaves the previous checkpoint intact and readable. Older checkpoints beyond
``keep`` are removed only after the new one is complete.

A resume checks the files against the manifest before any rank loads (each rank its own, rank 0
the shared ones) and the ranks agree, over the control group, on the newest checkpoint that every
rank found intact; one skipped is logged with the file, expected and found. A full disk, seen
before writing (free space against the last checkpoint's size) or while writing, removes the
partial directory and raises :class:`FileFault` on every rank with one message; so does a
resume that finds no intact checkpoint. ``metrics.jsonl`` and ``ledger.jsonl`` are appended
line by line (:func:`append_record`): a line that does not fit is taken back, and a resume
drops a torn last line left by a kill (:func:`rewind_records`).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import xxhash

log = logging.getLogger(__name__)

_PREFIX = "step_"
_MARKER = "COMPLETE"
_CHUNK = 1 << 20  # reads of 8 MiB took 4x longer on a 19 MB checkpoint: each maps fresh pages


class FileFault(RuntimeError):
    """A fault in the run's files that every rank raised together (the ranks agreed on it): a full
    disk, or no intact checkpoint to resume from. The run stops with this message."""


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def digest(path: Path) -> dict[str, Any]:
    """A file's size and xxh3-64, as the manifest records them."""
    h, size = xxhash.xxh3_64(), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "xxh3_64": h.hexdigest()}


class CheckpointManager:
    def __init__(self, run_dir: str | Path, *, keep: int = 2, group: dist.ProcessGroup | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = max(1, keep)
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.stop_requested = False
        self._stop_signal = 0  # the signal that asked for the stop, for rank 0's one line

    # --- discovery -------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the checkpoints marked complete (intact or not: see :meth:`resume_step`)."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name[len(_PREFIX):]) for p in self.root.glob(f"{_PREFIX}*")
                      if p.name[len(_PREFIX):].isdigit() and (p / _MARKER).exists())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}"

    def manifest(self, step: int) -> dict[str, Any] | None:
        """The files the checkpoint of ``step`` was written with; None for one written before manifests."""
        text = (self.path(step) / _MARKER).read_text()
        return None if text.strip().isdigit() else json.loads(text)

    def verify(self, step: int) -> list[str]:
        """What is wrong with this rank's files of checkpoint ``step`` (its own state; on rank 0 also
        every other file), one line per fault; empty when intact."""
        path = self.path(step)
        try:
            manifest = self.manifest(step)
        except (OSError, ValueError) as exc:
            return [f"{path / _MARKER}: not a readable manifest ({exc})"]
        if manifest is None:
            if self.rank == 0:
                log.warning("checkpoint step %d predates checksums: its files are not verified", step)
            return []
        files, mine = manifest["files"], f"rank{self.rank:05d}.pt"
        if manifest["world_size"] != self.world_size:
            return [f"{path} was written by {manifest['world_size']} ranks, this run has {self.world_size}: "
                    "resume with the world size it was written with"]
        names = [mine] if self.rank else [n for n in files if n == mine or not n.startswith("rank")]
        problems = []
        for name in names:
            expected, file = files[name], path / name
            try:
                found = {"size": file.stat().st_size}
                if found["size"] == expected["size"]:
                    found = digest(file)
            except OSError as exc:
                problems.append(f"{file}: unreadable ({exc.strerror})")
                continue
            if found != expected:
                problems.append(f"{file}: expected {_describe(expected)}, found {_describe(found)}")
        return problems

    # --- save / load -----------------------------------------------------
    def save(self, step: int, rank_state: dict[str, Any], shared_state: dict[str, Any] | None = None,
             export: Callable[[Path], None] | None = None, before_commit: Callable[[], None] | None = None) -> Path:
        """Collective over ``group``: every rank passes its own state; rank 0 also the shared state.

        ``export(dir)``, when given, is called on every rank to write more files into the
        checkpoint (the HF export of the policy) before it is marked complete.
        ``before_commit()``, when given, is called on every rank once every file is written and
        before the checkpoint is marked complete: a record of the step written there (the ledger,
        the metrics) is never missing from a run resumed from this checkpoint.
        A full disk, before or while writing, raises :class:`FileFault` on every rank with the
        partial checkpoint removed and the previous ones kept.
        """
        final, tmp = self.path(step), self.path(step).with_name(self.path(step).name + ".tmp")
        needed, basis = self._needed(rank_state, shared_state)
        self.root.mkdir(parents=True, exist_ok=True)

        def check_space() -> None:  # before any rank writes; the ranks share one filesystem, rank 0 measures it
            free = shutil.disk_usage(self.root).free
            if self.rank == 0 and free < needed:
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: refused before writing")
        if self.rank == 0:  # a save killed half-way left it; its space counts as free
            shutil.rmtree(tmp, ignore_errors=True)
        self._agree_or_stop(step, tmp, needed, basis, check_space)
        if self.rank == 0:
            tmp.mkdir(parents=True)
        self._barrier()

        def write_state() -> None:
            _atomic_torch_save({**rank_state, "rng": rng_state()}, tmp / f"rank{self.rank:05d}.pt")
            if self.rank == 0:
                _atomic_torch_save(shared_state or {}, tmp / "shared.pt")
        self._agree_or_stop(step, tmp, needed, basis, write_state)
        if export is not None:
            self._agree_or_stop(step, tmp, needed, basis, lambda: export(tmp))
        started = time.perf_counter()
        files = self._digests(tmp)
        digest_s = time.perf_counter() - started

        def commit() -> None:
            if before_commit is not None:
                before_commit()
            if self.rank == 0:
                manifest = {"step": step, "world_size": self.world_size, "files": files}
                _write_all(tmp / _MARKER, (json.dumps(manifest, indent=1) + "\n").encode())
        self._agree_or_stop(step, tmp, needed, basis, commit)
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.path(old), ignore_errors=True)
            log.info("checkpoint step %d written to %s: %d files, %s bytes, checksums in %.3fs", step, final,
                     len(files), f"{sum(f['size'] for f in files.values()):,}", digest_s)
        self._barrier()
        return final

    def resume_step(self, pinned: int | None = None) -> int | None:
        """Collective: the newest checkpoint that every rank finds intact, or ``pinned`` (``run.resume_from``);
        None when there is no complete checkpoint. Damaged ones are skipped with a warning naming the file.
        Raises :class:`FileFault` when checkpoints exist but none is intact, or ``pinned`` is absent or
        damaged. Checkpoints after the chosen one are removed: their steps are redone."""
        box = [self.steps()]  # rank 0's view, so that every rank walks the same list
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0, group=self.group)
        steps = box[0]
        if pinned is not None and pinned not in steps:
            raise FileFault(f"run.resume_from={pinned}: {self.root} has no complete checkpoint of step {pinned} "
                            f"(complete: {', '.join(map(str, steps)) or 'none'})")
        damaged: list[str] = []
        for step in [pinned] if pinned is not None else reversed(steps):
            # each rank's faults, once each (a world-size mismatch is seen by every rank)
            problems = list(dict.fromkeys(p for mine in self._all_gather(self.verify(step)) for p in mine))
            if not problems:
                self._drop_after(step, steps)
                self._barrier()  # removed before any rank looks again
                return step
            damaged.append(f"step {step}: " + "; ".join(problems))
            if self.rank == 0:
                log.warning("checkpoint step %d is damaged, skipped: %s", step, "; ".join(problems))
        if not damaged:
            return None
        what = f"run.resume_from={pinned}: checkpoint step {pinned} is damaged" if pinned is not None else \
            f"no intact checkpoint in {self.root}"
        raise FileFault(f"{what}: " + " | ".join(damaged) + ". Move the damaged directories away to start "
                        "from the beginning, or restore the files")

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load this rank's state (RNG restored) and, on rank 0, the shared state for ``step``."""
        path = self.path(step)
        rank_file = path / f"rank{self.rank:05d}.pt"
        if not rank_file.exists():
            raise FileNotFoundError(f"checkpoint {path} has no state for rank {self.rank}: "
                                    "was it written with a different world size?")
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        set_rng_state(rank_state.pop("rng"))
        shared = torch.load(path / "shared.pt", map_location="cpu", weights_only=False) if self.rank == 0 else {}
        return rank_state, shared

    # --- agreement on faults -------------------------------------------------
    def agreed(self, write: Callable[[], None]) -> None:
        """Collective: call ``write`` on every rank; a failed write (a full disk) on any rank raises
        :class:`FileFault` on every rank naming it, instead of one rank dying while the others wait."""
        fault = None
        try:
            write()
        except FileFault as exc:
            fault = f"rank {self.rank}: {exc}"
        except Exception as exc:  # only write errors become a fault; anything else is a bug to see
            if not _is_write_error(exc):
                raise
            fault = f"rank {self.rank}: {exc}"
        faults = [f for f in self._all_gather(fault) if f]
        if faults:
            raise FileFault("; ".join(faults))

    def _agree_or_stop(self, step: int, tmp: Path, needed: int, basis: str, write: Callable[[], None]) -> None:
        try:
            self.agreed(write)
        except FileFault as exc:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._barrier()
            kept = ", ".join(map(str, self.steps())) or "none"
            free = shutil.disk_usage(self.root).free
            raise FileFault(
                f"checkpoint step {step} not written to {self.root}: {exc}. It needs about {needed:,} bytes "
                f"({basis}); {free:,} bytes are free there now (nothing of step {step} is left; checkpoints "
                f"kept: {kept}). Free space or point run.output_dir at a larger filesystem, then run the same "
                "command to resume") from None

    def _needed(self, rank_state: dict[str, Any], shared_state: dict[str, Any] | None) -> tuple[int, str]:
        """Collective: bytes the next checkpoint will take, the last one's size (the tensors' sum for the first)."""
        tensors = sum(self._all_gather(_nbytes(rank_state) + _nbytes(shared_state)))
        last = self.latest()
        manifest = self.manifest(last) if last is not None else None
        if manifest is None:
            return tensors, "estimated from the tensors to save"
        return sum(f["size"] for f in manifest["files"].values()), f"the size of step {last}'s checkpoint"

    def _digests(self, tmp: Path) -> dict[str, dict[str, Any]]:
        """Collective: each rank digests its own state file, rank 0 every other file (on rank 0: all)."""
        mine = f"rank{self.rank:05d}.pt"
        files = {name: d for part in self._all_gather({mine: digest(tmp / mine)}) for name, d in part.items()}
        if self.rank == 0:
            for p in sorted(tmp.rglob("*")):
                if p.is_file() and p.relative_to(tmp).as_posix() not in files:
                    files[p.relative_to(tmp).as_posix()] = digest(p)
        return files

    def _drop_after(self, step: int, steps: list[int]) -> None:
        """Rank 0 removes the checkpoints after the resumed one (damaged, or from steps now redone), so
        that a later restart cannot resume from a future this run no longer has."""
        if self.rank != 0:
            return
        for later in (s for s in steps if s > step):
            log.warning("removing checkpoint step %d (%s): the run resumes from step %d and redoes it",
                        later, self.path(later), step)
            shutil.rmtree(self.path(later), ignore_errors=True)

    # --- preemption --------------------------------------------------------
    def install_stop_handlers(self) -> None:
        """SIGTERM (Slurm preemption, scancel) and SIGINT (Ctrl-C: torchrun passes its own signal on to the
        ranks) ask for a checkpoint at the end of the step."""
        def _handler(signum, frame):
            if self.rank == 0:
                log.warning("%s received: finishing this step, then checkpoint and exit", signal.Signals(signum).name)
            self.stop_requested, self._stop_signal = True, signum
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _handler)

    def any_stop_requested(self) -> bool:
        """True on every rank if any rank was asked to stop (collective). Rank 0 says so once: when it got the
        signal itself, or here when only another rank did (a scancel of one node's ranks)."""
        if not dist.is_initialized():
            return self.stop_requested
        flag = torch.tensor([self._stop_signal or int(self.stop_requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        received = int(flag.item())
        if received and self.rank == 0 and not self.stop_requested:
            what = signal.Signals(received).name if received in (signal.SIGTERM, signal.SIGINT) else "a stop request"
            log.warning("%s received by another rank: checkpointing this step, then exit", what)
            self.stop_requested = True
        return bool(received)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def _all_gather(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


# --- the run's append-only records (metrics.jsonl, ledger.jsonl) ---------------------------------------
def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line. A line that does not fit (a full disk) is taken back, leaving the file as
    it was, and the OSError names the file, the bytes needed and the bytes free."""
    line = (json.dumps(record) + "\n").encode()
    with open(path, "ab", buffering=0) as f:
        start = f.seek(0, os.SEEK_END)
        try:
            _write_fully(f, line)
        except OSError as exc:
            f.truncate(start)
            raise OSError(exc.errno, f"{exc.strerror}: appending a {len(line):,}-byte line to {path} "
                          f"({shutil.disk_usage(path.parent).free:,} bytes free in {path.parent})") from None


def rewind_records(path: Path, step: int) -> None:
    """Keep the lines of steps <= ``step`` (a resumed run redoes the later ones). A torn last line (a
    kill or a full disk mid-write) is dropped and logged; a line that is not JSON elsewhere is refused."""
    lines = path.read_bytes().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((json.loads(line), line))
        except ValueError:
            preview = line[:80].decode(errors="replace")
            if number < len(lines):
                raise FileFault(f"{path}: line {number} is not JSON ({preview!r}) and is not the last line: "
                                "the file is damaged; remove that line to resume") from None
            log.warning("%s: dropped a torn last line (line %d, %d bytes, not JSON: %r)", path, number,
                        len(line), preview)
    path.write_bytes(b"".join(line + b"\n" for row, line in rows if row["step"] <= step))


# --- helpers -----------------------------------------------------------------------------------------
def _describe(d: dict[str, Any]) -> str:
    return f"{d['size']:,} bytes" + (f" xxh3 {d['xxh3_64']}" if "xxh3_64" in d else "")


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _is_write_error(exc: BaseException) -> bool:
    """An OSError, or safetensors' error for one (a Rust error that carries the OS error as text)."""
    return isinstance(exc, OSError) or (type(exc).__name__ == "SafetensorError" and "I/O error" in str(exc))


def _write_fully(f, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def _write_all(path: Path, data: bytes) -> None:
    with open(path, "wb", buffering=0) as f:
        _write_fully(f, data)


def _atomic_torch_save(obj: Any, path: Path) -> None:
    # Through a Python file: a full disk raises OSError(ENOSPC) naming the file (torch.save to a path
    # raises "basic_ios::clear: iostream error").
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as f:
            torch.save(obj, f)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    os.replace(part, path)
