"""Megatron-core's warnings that Transformer Engine or Apex is missing, said once instead of per module.

megatron-core warns at import of each module that would use them (14 warnings per rank on a CPU
machine). Without them it runs its plain-PyTorch layers, norms and optimizer: the same numbers,
slower on a GPU (the GPU trainer backend uses Transformer Engine where it is installed).
"""
from __future__ import annotations

import importlib.util
import warnings

_NOT_INSTALLED = r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed"


def quiet_missing_kernel_warnings() -> str | None:
    """Filter those warnings in this process; returns the one line to log instead (None: both installed)."""
    warnings.filterwarnings("ignore", message=_NOT_INSTALLED, category=UserWarning)
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return (f"{' and '.join(missing)} not installed: megatron-core uses its plain-PyTorch layers, norms and "
            "optimizer (the same numbers; on a GPU slower than the fused kernels, on a CPU nothing is lost)")
