"""INT4, symmetric, one fp32 scale per group of `group_size` consecutive elements along the last (input)
dimension: q = clamp(round(x / s), -8, 7) with s = group amax / 7.5 (torchao's symmetric mapping over [-8, 7]),
rounding half to even. Two values pack into a byte (low nibble first). An all-zero group gets the smallest
positive scale (torchao's eps) and dequantizes to zeros.

Built on torchao's affine primitives (`choose_qparams_affine`, `quantize_affine`, `dequantize_affine`)."""

from __future__ import annotations

import torch
from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, dequantize_affine, quantize_affine

from miles_sync.formats import QuantizationError, Quantized

QMIN, QMAX = -8, 7


def quantize(x: torch.Tensor, name: str = "tensor", group_size: int = 128) -> Quantized:
    if x.shape[-1] % group_size:
        raise QuantizationError(
            f"{name}: INT4 group size {group_size} does not divide the input dimension {x.shape[-1]}; "
            "choose a quant_group_size that does"
        )
    block = (1, group_size)
    scale, zero = choose_qparams_affine(
        x, MappingType.SYMMETRIC, block, torch.int8, QMIN, QMAX, eps=torch.finfo(torch.float32).eps
    )
    q = quantize_affine(x, block, scale, zero, torch.int8, QMIN, QMAX)  # symmetric: zero is 0
    nibbles = (q.to(torch.uint8) & 0x0F).reshape(-1, 2)
    packed = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return Quantized("int4", packed, (scale.reshape(x.shape[0], -1),), x.shape, {"group_size": group_size})


def unpack(q: Quantized) -> torch.Tensor:
    """The int8 values of a packed INT4 tensor, in its shape."""
    low, high = (q.data & 0x0F).to(torch.int8), (q.data >> 4).to(torch.int8)
    values = torch.stack([low, high], dim=-1).reshape(q.shape)
    return torch.where(values > 7, values - 16, values)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    block = (1, q.options["group_size"])
    zero = torch.zeros_like(q.scales[0], dtype=torch.int32)
    return dequantize_affine(unpack(q), block, q.scales[0], zero, torch.int8, QMIN, QMAX, output_dtype=dtype)
