"""Cluster-scale simulator: the real scheduler over modeled engines on a virtual clock."""
from rollpacker.sim.engine import SimEngine
from rollpacker.sim.perf import H800, QWEN25, Efficiency, GPUSpec, ModelSpec, PerfModel
from rollpacker.sim.reward import SimRewardSink, SimScore
from rollpacker.sim.run import SimCluster, SimSettings, run_mode, summarize
from rollpacker.sim.epochs import EpochRun, compare, run_epochs
from rollpacker.sim.traces import (LengthOracle, PromptLengths, TraceError, calibrate_rho, epoch_spearman, load_trace,
                                   longtail_trace, multi_epoch_trace)

__all__ = ["SimEngine", "H800", "QWEN25", "Efficiency", "GPUSpec", "ModelSpec", "PerfModel", "SimRewardSink",
           "SimScore", "SimCluster", "SimSettings", "run_mode", "summarize", "EpochRun", "compare", "run_epochs",
           "LengthOracle", "PromptLengths", "TraceError", "calibrate_rho", "epoch_spearman", "load_trace",
           "longtail_trace", "multi_epoch_trace"]
