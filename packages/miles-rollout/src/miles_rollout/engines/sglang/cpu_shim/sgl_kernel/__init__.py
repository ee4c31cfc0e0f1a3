"""CPU-only import shim for `sgl_kernel` (SGLang's CUDA kernel package, published only as CUDA builds).

SGLang's CPU path imports a few names from `sgl_kernel` at module import time but, for dense
Qwen2/Llama models on the torch-native attention backend, calls none of them. Every attribute here
is a function that raises, so any real use fails loudly and names the op. Put this folder on
PYTHONPATH for CPU runs only; never ship it to a GPU machine.
"""

from typing import Any


class _MissingOp:
    def __init__(self, name: str) -> None:
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{self.__name__} is not available on CPU (miles CPU shim)")

    def __getattr__(self, name: str) -> "_MissingOp":
        return _MissingOp(f"{self.__name__}.{name}")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _MissingOp(name)


def _without_pinned_memory() -> None:
    """SGLang's LoRA layers and memory pool (`--enable-lora`) allocate host buffers with `pin_memory=True`, which
    needs a CUDA driver: on a machine without one, pinned memory is plain host memory here (what pinning buys,
    faster host-to-GPU copies, has no meaning without a GPU). SGLang imports this module in every server process
    before it builds a model, so the patch is in place for them all."""
    import functools

    import torch

    if torch.cuda.is_available():
        return

    def unpinned(factory: Any) -> Any:
        @functools.wraps(factory)
        def make(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return make

    factories = (torch.tensor, torch.empty, torch.zeros, torch.ones, torch.full, torch.arange)
    for factory in (*factories, torch.empty_like, torch.zeros_like, torch.ones_like):
        setattr(torch, factory.__name__, unpinned(factory))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    # The same for host buffers SGLang registers with the CUDA runtime itself (`cudaHostRegister`: the host cache of
    # `--enable-return-routed-experts`): with no driver, the runtime below is a stand-in that registers nothing and
    # reports success, so those buffers are plain host memory.
    torch.cuda.cudart = lambda: _NoCudaRuntime()  # type: ignore[assignment]


class _NoCudaRuntime:
    """What SGLang's host-memory registration calls of the CUDA runtime, on a machine without one (a stand-in)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - the CUDA runtime's name
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0

    def cudaGetErrorString(self, rc: int) -> str:  # noqa: N802
        return "no CUDA runtime (miles CPU shim)"


_without_pinned_memory()
