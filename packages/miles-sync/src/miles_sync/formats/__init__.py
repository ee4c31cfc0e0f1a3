"""Low-precision weight formats: one module per format, each with `quantize(x) -> Quantized` and
`dequantize(q) -> Tensor`, built on torchao's primitives (see each module for which).

`fake_quantize` is the round trip (the values of the format's grid, in the input's dtype): what the engines run
when a push is quantized on a machine that emulates the format (`sync.quantization`), and what the trainer
forwards with under `train.quantization`. `quantizable` says which weights a format applies to: the 2-D weights
of linear layers, never embeddings, the output head, norms or a MoE router (the usual weight-only recipe).

Inputs must be finite: a NaN or an infinity has no place on any of these grids (NVFP4 and MXFP8 would spread it to
the whole block through the shared scale), so `quantize` refuses it with `QuantizationError` naming the tensor.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

FORMAT_NAMES = ("fp8", "fp8_block", "mxfp8", "nvfp4", "int4")
DEFAULT_INT4_GROUP = 128

# Names that mark a 2-D weight as an embedding, the output head or a router, in the three naming schemes the
# trainers use (HF, megatron-core, torchtitan).
_NOT_LINEAR = ("embed", "lm_head", "output_layer", "router", "norm")
_NOT_LINEAR_SUFFIX = ("output.weight", ".gate.weight")


class QuantizationError(ValueError):
    """A tensor a format cannot take (non-finite values, a shape its blocks do not divide)."""


@dataclass
class Quantized:
    """A quantized tensor: `data` holds the packed values, `scales` the block scales (and, for NVFP4, the fp32
    tensor scale last); `shape` is the original shape. `nbytes` is what a push of it carries."""

    format: str
    data: torch.Tensor
    scales: tuple[torch.Tensor, ...]
    shape: torch.Size
    options: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, *self.scales))


def _module(fmt: str):
    name = "fp8" if fmt == "fp8_block" else fmt
    if name not in FORMAT_NAMES:
        raise QuantizationError(f"unknown quantization format {fmt!r}; choose one of {', '.join(FORMAT_NAMES)}")
    return importlib.import_module(f"miles_sync.formats.{name}")


def _options(fmt: str, group_size: int) -> dict:
    if fmt == "fp8_block":
        return {"block": (128, 128)}
    if fmt == "int4":
        return {"group_size": group_size}
    return {}


def check_finite(x: torch.Tensor, what: str) -> None:
    if not torch.isfinite(x).all():
        raise QuantizationError(f"{what} holds NaN or infinite values: no low-precision format can represent them")


def quantize(x: torch.Tensor, fmt: str, group_size: int = DEFAULT_INT4_GROUP, name: str = "tensor") -> Quantized:
    """Quantize `x` (2-D) to `fmt`; `group_size` is INT4's group along the input (last) dimension."""
    if x.dim() != 2:
        raise QuantizationError(f"{name}: {fmt} quantizes 2-D weights; got shape {tuple(x.shape)}")
    check_finite(x, name)
    return _module(fmt).quantize(x.detach().float(), name=name, **_options(fmt, group_size))


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _module(q.format).dequantize(q, dtype)


def fake_quantize(
    x: torch.Tensor, fmt: str, group_size: int = DEFAULT_INT4_GROUP, name: str = "tensor"
) -> torch.Tensor:
    """`x` rounded to the grid of `fmt` (quantize then dequantize), in `x`'s dtype and device."""
    q = quantize(x.detach().cpu(), fmt, group_size, name)
    return dequantize(q, torch.float32).to(dtype=x.dtype, device=x.device)


def quantizable(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """True for the weights a format applies to: 2-D `.weight`s of linear layers (see the module docstring)."""
    if len(shape) != 2 or not name.endswith("weight"):
        return False
    return not any(part in name for part in _NOT_LINEAR) and not name.endswith(_NOT_LINEAR_SUFFIX)


def quantized_for_push(named_tensors, fmt: str | None, group_size: int = DEFAULT_INT4_GROUP):
    """The stream of a push with its linear weights rounded to `fmt`'s grid (a no-op for None or "none")."""
    for name, tensor in named_tensors:
        if fmt not in (None, "none") and quantizable(name, tensor.shape):
            tensor = fake_quantize(tensor, fmt, group_size, name)
        yield name, tensor


def packed_bytes(named_tensors, fmt: str | None, group_size: int = DEFAULT_INT4_GROUP, wire_itemsize: int = 2) -> int:
    """Bytes a push of these tensors carries when the linear weights travel packed in `fmt` (with their scales)
    and the rest at `wire_itemsize` bytes per element: what a GPU engine loading real quantized weights receives."""
    total = 0
    for name, tensor in named_tensors:
        if fmt not in (None, "none") and quantizable(name, tensor.shape):
            total += quantize(tensor.detach().cpu(), fmt, group_size, name).nbytes
        else:
            total += tensor.numel() * wire_itemsize
    return total
