"""Shim for sglang on CPU: declare torchvision's NMS op schemas before torchvision is imported, unless
torchvision's own compiled ops load (then they declare them).

Why: sglang imports torchvision unconditionally, and the torchvision 0.28.0 wheel on the index is a
CUDA build whose ``_C`` extension cannot load against torch 2.13.0+cpu. Its ``_meta_registrations``
then calls ``register_fake("torchvision::nms")`` for an operator that was never defined, and the
import dies ("operator torchvision::nms does not exist"). Declaring the two schemas (no kernels: any
call fails loudly) lets the import finish; sglang's CPU path never calls them.

Where torchvision matches torch (torch 2.11.0 with torchvision 0.26.0, the CUDA builds sglang 0.5.17
pins, which also run on a host without a GPU), ``_C`` loads and defines the schemas itself; declaring
them first would make that load abort the process ("Tried to register an operator
(torchvision::nms ...) multiple times"). So the shim loads ``_C`` first and declares only if it fails.

Loaded by ``rollpacker_torchvision_schemas.pth`` in every interpreter of the venv, including the
processes sglang spawns. Only a ``sys.meta_path`` hook is installed at startup: torch is imported
when something first imports torchvision, not in every process (pip included).
"""
import importlib.util
import sys
from pathlib import Path


def _own_ops_load(torch) -> bool:
    """Whether torchvision's compiled ops load against this torch."""
    spec = importlib.util.find_spec("torchvision")  # locates it without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for lib in Path(folder).glob("_C*.so"):
            try:
                torch.ops.load_library(str(lib))
                return True
            except Exception:  # built against another torch
                return False
    return False


class _DeclareBeforeTorchvision:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            if not _own_ops_load(torch):
                global _LIB
                _LIB = torch.library.Library("torchvision", "DEF")  # must outlive the import
                _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None  # the regular finders import torchvision itself


sys.meta_path.insert(0, _DeclareBeforeTorchvision())
