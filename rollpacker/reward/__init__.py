"""Reward: CPU worker pools that score each response as soon as it finishes: rollout keeps the GPUs busy while the CPUs score."""
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.pool import PoolStats, RewardPool
from rollpacker.reward.score import REASONS, Score

__all__ = ["REASONS", "PoolStats", "RewardConfig", "RewardPool", "Score"]
