"""torchrun script: ``rollpacker.train`` as shipped, on which one rank stops itself (SIGSTOP) at a
point of the step that the environment names, so that a test signals it exactly there instead of
polling for a window that may be shorter than its poll.

    STOP_AT=POINT STOP_RANK=R STOP_STEP=N STOP_MARKER=FILE torchrun ... train_stop_at.py --config ...

POINT is one of
  ``rollout``       rank R enters step N's rollout (its weight sync done);
  ``stream_train``  rank R's stream trainer is about to train the first group fed to it in step N;
  ``checkpoint``    rank R has written its own state into step N's checkpoint, not yet complete.
There the rank writes its pid to FILE and stops; the test sees it stopped and kills it, or signals
it and continues it (SIGCONT). Nothing else of the program changes.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollpacker.runtime.run import Run
    from rollpacker.trainer.stream import StreamTrainer

POINTS = ("rollout", "stream_train", "checkpoint")
POINT, RANK, STEP, MARKER = (os.environ[k] for k in ("STOP_AT", "STOP_RANK", "STOP_STEP", "STOP_MARKER"))
if POINT not in POINTS:
    raise SystemExit(f"STOP_AT={POINT!r}: expected one of {POINTS}")
_state = {"step": 0, "stopped": False}


def _stop_here(point: str) -> None:
    if (point, _state["step"], os.environ["RANK"]) != (POINT, int(STEP), RANK) or _state["stopped"]:
        return
    _state["stopped"] = True
    Path(MARKER + ".part").write_text(str(os.getpid()))
    os.replace(MARKER + ".part", MARKER)
    os.kill(os.getpid(), signal.SIGSTOP)


def _around(owner, name: str, hook) -> None:
    """Replace ``owner.name`` by ``hook``, which gets the original first."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return hook(original, *args, **kwargs)

    setattr(owner, name, wrapped)


def _resume(original, run: Run) -> int:
    _state["step"] = original(run)  # the last completed step
    return _state["step"]


def _plan_round(original, run: Run, *args):
    _state["step"] += 1  # the first phase of every step
    return original(run, *args)


def _rollout(original, run: Run, *args):
    _stop_here("rollout")
    return original(run, *args)


def _consume(original, stream: StreamTrainer, *args):
    _stop_here("stream_train")
    return original(stream, *args)


def _save(original, obj, path: Path) -> None:
    original(obj, path)
    if path.name == f"rank{int(RANK):05d}.pt":
        _stop_here("checkpoint")


if __name__ == "__main__":
    # imported here, not at the top: the reward workers run this file as their main module
    # (forkserver) and must not pay for the trainer's imports (rollpacker/train.py does the same)
    from rollpacker import checkpoint
    from rollpacker.runtime.run import Run
    from rollpacker.train import main
    from rollpacker.trainer.stream import StreamTrainer

    for owner, name, hook in ((Run, "resume", _resume), (Run, "plan_round", _plan_round), (Run, "rollout", _rollout),
                              (StreamTrainer, "consume", _consume), (checkpoint, "_atomic_torch_save", _save)):
        _around(owner, name, hook)
    sys.exit(main(sys.argv[1:]))
