"""DAPO-style dynamic sampling on top of tail batching.

It is the tail-batching race with one change: a prompt that completes (its
first R0 responses generated and scored) with all R0 rewards equal carries no
GRPO signal, so it is *filtered* — counted, never trained, never queued — and
one replacement prompt is launched at once so the round still ends at P0
valid groups. A short round's replacement is a fresh prompt with ⌈η_R·R0⌉
responses; a long round's is the next queued prompt (FIFO) or, with the queue
empty, a fresh one, with exactly R0 responses. Prompts still unfinished when
a short round closes go to the queue as in tail batching. Filtering needs the
rewards during the race, so this mode requires asynchronous reward.
"""
from __future__ import annotations


from rollpacker.sample import Prompt, SampleGroup
from rollpacker.scheduler.modes.tail_batching import TailBatchingPolicy
from rollpacker.scheduler.protocols import PromptSource
from rollpacker.scheduler.queue import LongPromptQueue
from rollpacker.scheduler.round import RoundKind


class DynamicSamplingPolicy(TailBatchingPolicy):
    def keeps(self, group: SampleGroup) -> bool:
        return len(set(group.rewards)) > 1

    def replacement(self, kind: RoundKind, queue: LongPromptQueue, source: PromptSource) -> Prompt | None:
        if kind is RoundKind.LONG and len(queue):
            return queue.pop(1)[0]
        return source.take(1)[0]
