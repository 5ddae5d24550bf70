"""What became of each request of a step: the completions table and the rollout Gantt.

Both read the round's ``RoundTrace`` (scheduler/round.py): every launched
request, the engines that held it and when (on the coordinator's clock, from
submission until its completion was collected or it was aborted), and its
outcome — trained, filtered, aborted (an over-launched extra) or deferred to
the long round — and whether it migrated off an engine handed to the stream
trainer. Rank 0 writes the Gantt beside the step's timeline and logs both to W&B.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

from rollpacker.metrics import save_chart
from rollpacker.scheduler.round import Outcome, RequestTrace, RoundResult, RoundTrace

OUTCOME_COLOURS = {Outcome.TRAINED: "#55A868", Outcome.FILTERED: "#CCB974", Outcome.ABORTED: "#C44E52",
                   Outcome.DEFERRED: "#DD8452"}
MIGRATED_COLOUR = "#8172B3"  # a migrated request's time on the engine that left for the stream trainer
TRAINING_COLOUR = "#2E7D32"  # a released engine's lane from the hand-off on (as stream_train in the timeline)

# Rows of one step's completions table: a GPU round launches thousands of requests, and a table of
# that many full responses would dwarf the rest of the run's W&B files.
MAX_TABLE_ROWS = 64
TABLE_COLUMNS = ("step", "uid", "epoch", "response_index", "data_source", "round", "engine_tp", "engine", "outcome",
                 "migrated", "reward", "response_tokens", "finish_reason", "prompt", "response")


def pick_requests(requests: Sequence[RequestTrace], limit: int = MAX_TABLE_ROWS) -> list[RequestTrace]:
    """All requests when at most ``limit``; else ``limit`` of them, in launch order, shared out
    round robin over (outcome, migrated) so that a rare outcome is shown, and evenly spread over
    each kind's requests."""
    if len(requests) <= limit:
        return list(requests)
    kinds: dict[tuple[Outcome, bool], list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        kinds[r.outcome, r.migrated].append(i)
    quota = dict.fromkeys(kinds, 0)
    left = limit
    while left:
        for kind, members in kinds.items():
            if left and quota[kind] < len(members):
                quota[kind] += 1
                left -= 1
    chosen = {members[j * len(members) // quota[kind]] for kind, members in kinds.items()
              for j in range(quota[kind])}
    return [requests[i] for i in sorted(chosen)]


def completion_rows(step: int, result: RoundResult, decode: Callable[[list[int]], str],
                    limit: int = MAX_TABLE_ROWS) -> list[list]:
    """The step's table rows (``TABLE_COLUMNS``). A request that never finished (aborted or deferred
    while generating) has no response, reward or length: its partial tokens were discarded."""
    rows = []
    for r in pick_requests(result.trace.requests, limit):
        s, done = r.sample, r.sample.finish_reason is not None
        rows.append([step, s.prompt.uid, s.prompt.epoch, s.response_index, s.prompt.data_source,
                     result.kind.value, result.tp, r.placements[-1][0], r.outcome.value, r.migrated, s.reward,
                     s.num_response_tokens if done else None, s.finish_reason, decode(s.prompt.input_ids),
                     decode(list(s.response_ids)) if done else ""])
    return rows


def _slots(trace: RoundTrace) -> tuple[list[tuple[int, float, float, str]], list[int]]:
    """Each placement as (row, start, end, colour), and each engine's first row: an engine's lane
    has one row per request it held at once (a request takes the lowest row free at its start)."""
    by_engine: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for r in trace.requests:
        for k, (engine, start, end) in enumerate(r.placements):
            colour = MIGRATED_COLOUR if k < len(r.placements) - 1 else OUTCOME_COLOURS[r.outcome]
            by_engine[engine].append((start, end, colour))
    bars, first_row, row = [], [], 0
    for engine in range(trace.engines):
        first_row.append(row)
        ends: list[float] = []  # per row of this lane, when its last bar ends
        for start, end, colour in sorted(by_engine[engine]):
            free = next((i for i, e in enumerate(ends) if e <= start), None)
            if free is None:
                free = len(ends)
                ends.append(end)
            ends[free] = end
            bars.append((row + free, start, end, colour))
        row += max(1, len(ends)) + 1  # a blank row between lanes
    first_row.append(row)
    return bars, first_row


def plot_gantt(trace: RoundTrace, path: Path, title: str) -> Path:
    """One bar per request on its engine's lane, coloured by outcome; the hand-off to the stream
    trainer (a dashed line, the released lanes shaded after it) and the round's close marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars, first_row = _slots(trace)
    rows = first_row[-1] - 1  # lane e: rows first_row[e] .. first_row[e + 1] - 2
    fig, ax = plt.subplots(figsize=(10, 2.6 + 0.4 * trace.engines + min(8.0, 0.05 * rows)))
    for colour in {c for *_, c in bars}:
        mine = [b for b in bars if b[3] == colour]
        ax.barh([b[0] for b in mine], [max(b[2] - b[1], 1e-3) for b in mine], left=[b[1] for b in mine],
                height=0.8, color=colour, linewidth=0)
    handles = [matplotlib.patches.Patch(color=OUTCOME_COLOURS[o], label=o.value)
               for o in Outcome if any(r.outcome is o for r in trace.requests)]
    if any(r.migrated for r in trace.requests):
        handles.append(matplotlib.patches.Patch(color=MIGRATED_COLOUR, label="migrated (before the hand-off)"))
    if trace.handoff_at is not None:
        for engine in trace.released:
            ax.broken_barh([(trace.handoff_at, trace.closed_at - trace.handoff_at)],
                           (first_row[engine] - 0.5, first_row[engine + 1] - first_row[engine] - 1),
                           color=TRAINING_COLOUR, alpha=0.15)
        handles.append(matplotlib.patches.Patch(color=TRAINING_COLOUR, alpha=0.15, label="stream training"))
        released = ", ".join(map(str, trace.released))
        handles.append(ax.axvline(trace.handoff_at, color="black", linestyle="--", linewidth=1,
                                  label=f"hand-off: engine {released} to the stream trainer"))
    handles.append(ax.axvline(trace.closed_at, color="#777777", linestyle=":", linewidth=1, label="round closed"))
    ax.set_yticks([(first_row[e] + first_row[e + 1] - 2) / 2 for e in range(trace.engines)],
                  [f"engine {e}" + (" (to training)" if e in trace.released else "") for e in range(trace.engines)])
    ax.set_ylim(rows - 0.5, -0.5)
    ax.set_xlim(0, max(trace.closed_at, max((b[2] for b in bars), default=0.0)) * 1.02 or 1.0)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=min(len(handles), 3),
              frameon=False, fontsize=8)
    return save_chart(fig, ax, path, title=title,
                      xlabel="seconds since the round started (coordinator clock: submitted to collected or aborted)")
