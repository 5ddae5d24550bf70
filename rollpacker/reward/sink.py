"""The reward pool as the scheduler's ``RewardSink``: decode the response, score by data source."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from rollpacker.reward.pool import RewardPool
from rollpacker.sample import Sample


class PoolRewardSink:
    def __init__(self, pool: RewardPool, tokenizer: Any):
        self.pool, self.tokenizer = pool, tokenizer

    def submit(self, sample: Sample) -> Future:
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        p = sample.prompt
        # the adaptive code timeout keeps its anchors per prompt
        return self.pool.submit(p.data_source, text, p.ground_truth, key=f"p{p.uid}")
