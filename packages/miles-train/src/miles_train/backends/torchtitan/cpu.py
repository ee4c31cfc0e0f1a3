"""Adjustments that let torchtitan train on a machine without a GPU. All of them, and only here.

On a GPU machine `apply()` and `after_parallelize()` do nothing.
"""

from __future__ import annotations

import torch

_applied = False


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    """Call before anything imports `torchtitan.distributed`. No-op where CUDA is present."""
    global _applied
    if _applied or not needed():
        return
    _applied = True
    import sys

    import torchtitan.tools.utils as tt_utils

    # torchtitan picks its device once at import ("cuda" when nothing else is found) and its
    # distributed helpers build meshes and tensors on it: point it at the host. Modules that
    # already copied the value at their import get it too.
    for module in [tt_utils, *(m for n, m in list(sys.modules.items()) if n.startswith("torchtitan."))]:
        if getattr(module, "device_type", None) == "cuda":
            module.device_type, module.device_module = "cpu", torch.cpu


def after_parallelize(model: torch.nn.Module) -> None:
    """gloo has no PREMUL_SUM, which FSDP2 uses to scale gradients inside the reduce-scatter:
    ask FSDP2 for plain SUM collectives (it scales separately). No-op on GPU (NCCL has PREMUL_SUM)."""
    if not needed():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
