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

    def submit(self, sample: Sample) -> Future:
        p = sample.prompt
        # the adaptive code timeout keeps its anchors per prompt
        return self.pool.submit(p.data_source, sample.response_ids, p.ground_truth, key=f"p{p.uid}")
