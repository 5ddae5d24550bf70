"""The prompt ledger: which prompt (uid, epoch) was trained or filtered at which step.

Rank 0 appends one line per step to ``RUN_DIR/ledger.jsonl``. A resumed run
first drops the lines of steps after its checkpoint (they are redone), and a
torn last line, so the file always describes exactly the steps whose updates
the model contains.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from rollpacker.checkpoint import append_record, rewind_records
from rollpacker.sample import Prompt


class PromptLedger:
    def __init__(self, run_dir: Path, *, resume_step: int):
        self.path = Path(run_dir) / "ledger.jsonl"
        if self.path.exists():
            rewind_records(self.path, resume_step)

    def record(self, step: int, trained: list[Prompt], filtered: list[Prompt]) -> None:
        append_record(self.path, {"step": step, "trained": [[p.uid, p.epoch] for p in trained],
                                  "filtered": [[p.uid, p.epoch] for p in filtered]})


def read_ledger(path: Path) -> tuple[Counter, Counter]:
    """Counts of (uid, epoch) trained and filtered over the whole run."""
    trained, filtered = Counter(), Counter()
    for ln in Path(path).read_text().splitlines():
        rec = json.loads(ln)
        trained.update(tuple(x) for x in rec["trained"])
        filtered.update(tuple(x) for x in rec["filtered"])
    return trained, filtered
