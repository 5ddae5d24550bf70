"""Cluster-scale simulator: the real scheduler over modeled engines on a virtual clock."""
from rollpacker.sim.engine import SimEngine
from rollpacker.sim.perf import H800, QWEN25, Efficiency, GPUSpec, ModelSpec, PerfModel
from rollpacker.sim.reward import SimRewardSink, SimScore
from rollpacker.sim.run import SimSettings, run_mode, summarize
from rollpacker.sim.traces import LengthOracle, PromptLengths, TraceError, load_trace, longtail_trace

__all__ = ["SimEngine", "H800", "QWEN25", "Efficiency", "GPUSpec", "ModelSpec", "PerfModel", "SimRewardSink",
           "SimScore", "SimSettings", "run_mode", "summarize", "LengthOracle", "PromptLengths", "TraceError",
           "load_trace", "longtail_trace"]
