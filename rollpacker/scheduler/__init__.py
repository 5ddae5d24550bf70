"""The rollout scheduler: tail batching, its baseline, and the parallelism planner."""
from rollpacker.scheduler.clock import Clock, RealClock, VirtualClock
from rollpacker.scheduler.config import TPProfile
from rollpacker.scheduler.fleet import LocalFleet
from rollpacker.scheduler.planner import ParallelismPlanner
from rollpacker.scheduler.protocols import EventSource, PromptSource, RewardSink, Score, ScoreFuture
from rollpacker.scheduler.round import RoundKind, RoundPlan, RoundResult, RoundStats
from rollpacker.scheduler.scheduler import Scheduler
from rollpacker.scheduler.sources import ListPromptSource

__all__ = ["Clock", "RealClock", "VirtualClock", "LocalFleet", "ParallelismPlanner", "TPProfile", "EventSource", "PromptSource",
           "RewardSink", "Score", "ScoreFuture", "RoundKind", "RoundPlan", "RoundResult", "RoundStats", "Scheduler",
           "ListPromptSource"]
