"""Adjustments that let torchtitan train on a machine without a GPU. All of them, and only here.

On a GPU machine `apply()` and `after_parallelize()` do nothing.
"""

from __future__ import annotations

import torch

from miles_train.backends.common import on_host, once_on_host


@once_on_host
def apply() -> None:
    """Call before anything imports `torchtitan.distributed`. No-op where CUDA is present."""
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
    if not on_host():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
