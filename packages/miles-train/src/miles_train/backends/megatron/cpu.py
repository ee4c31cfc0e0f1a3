"""Adjustments that let megatron-core train on a machine without a GPU. All of them, and only here.

megatron-core assumes CUDA in a handful of places that are not about computation (where a buffer
is allocated, which stream waits, an assertion on the tensor type). On a GPU machine nothing in this
module does anything: `apply()` returns at once and `on_cpu()` is a no-op context.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from miles_train.backends.common import on_host, once_on_host


@once_on_host
def apply() -> None:
    """Patch the process once, before megatron-core builds anything. No-op where CUDA is present."""
    # Megatron's DDP allocates its contiguous gradient buffers with
    # `device=torch.cuda.current_device()`; answering "cpu" puts them in host memory.
    torch.cuda.current_device = lambda: "cpu"

    # The gradient buffers make the current stream wait on their communication events after an
    # asynchronous all-reduce. On CPU every collective here is synchronous: nothing to wait for.
    class _HostStream:
        def wait_event(self, event) -> None:
            pass

        def wait_stream(self, stream) -> None:
            pass

        def synchronize(self) -> None:
            pass

    torch.cuda.current_stream = lambda device=None: _HostStream()

    # `clip_grad_by_total_norm_fp32` asserts that every gradient is a `torch.cuda.FloatTensor` and
    # scales through apex's multi-tensor kernels; the same arithmetic on host tensors:
    import megatron.core.optimizer.optimizer as megatron_optimizer
    from megatron.core.utils import to_local_if_dtensor

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        coeff = max_norm / (float(total_norm) + 1.0e-6)
        if coeff >= 1.0:
            return
        for param in parameters:
            grad = param.decoupled_grad if use_decoupled_grad else param.grad
            if grad is not None:
                to_local_if_dtensor(grad).detach().mul_(coeff)

    megatron_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def init_rng_tracker() -> bool:
    """Megatron's training RNG tracker forks CUDA generators. Dropout is off and weights come from
    the checkpoint, so nothing draws from it: on CPU, the inference tracker (no fork) stands in.
    Returns False on GPU, where the caller seeds Megatron's own tracker."""
    if not on_host():
        return False
    from megatron.core import tensor_parallel

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device="cuda"` (and `.cuda()`) in torch calls to the host. Megatron's optimizer
    creates its flags, norms and loss scale with `device='cuda'` literally."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        name = getattr(func, "__name__", "")
        if name == "cuda":  # Tensor.cuda()
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:
            # Megatron's mixed-precision optimizer sorts parameters by their type name and accepts only
            # "torch.cuda.*Tensor": a host tensor answers as its CUDA twin (the dtype is what it checks).
            held = func(*args)
            return held.replace("torch.", "torch.cuda.", 1) if not held.startswith("torch.cuda.") else held
        return func(*args, **kwargs)


def on_cpu():
    """Context for megatron-core calls that create tensors on 'cuda' (optimizer build, step, state
    dicts). A no-op on GPU machines."""
    return _CudaToCpu() if on_host() else contextlib.nullcontext()
