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
