"""The reward pool as the scheduler's ``RewardSink``: score each response by its data source.

Responses go to the pool as token ids: its workers decode them, so the scheduler's thread spends
nothing per response on text (at a cluster's request rates that decode was rank 0's largest cost).
"""
from __future__ import annotations

from concurrent.futures import Future

from rollpacker.reward.pool import RewardPool
from rollpacker.sample import Sample


class PoolRewardSink:
    def __init__(self, pool: RewardPool):
        self.pool = pool

    def submit(self, sample: Sample, *, key: str | None = None, adapt: bool = True) -> Future:
        p = sample.prompt
        return self.pool.submit(p.data_source, sample.response_ids, p.ground_truth, key=key, adapt=adapt)
