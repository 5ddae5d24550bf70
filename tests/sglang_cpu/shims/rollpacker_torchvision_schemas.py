"""Shim for sglang 0.5.23 on CPU: declare torchvision's NMS op schemas before torchvision is imported.

Why: sglang imports torchvision unconditionally, and the torchvision 0.28.0 wheel on the index is a
CUDA build whose ``_C`` extension cannot load against torch 2.13.0+cpu. Its ``_meta_registrations``
then calls ``register_fake("torchvision::nms")`` for an operator that was never defined, and the
import dies ("operator torchvision::nms does not exist"). Declaring the two schemas (no kernels: any
call fails loudly) lets the import finish; sglang's CPU path never calls them.

Loaded by ``rollpacker_torchvision_schemas.pth`` in every interpreter of the venv, including the
processes sglang spawns. Only a ``sys.meta_path`` hook is installed at startup: torch is imported
when something first imports torchvision, not in every process (pip included).
"""
import sys


class _DeclareBeforeTorchvision:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            global _LIB
            _LIB = torch.library.Library("torchvision", "DEF")  # must outlive the import
            _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None  # the regular finders import torchvision itself


sys.meta_path.insert(0, _DeclareBeforeTorchvision())
