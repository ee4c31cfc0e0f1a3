"""FP8 (OCP 8-bit floating point): E4M3 (max 448, no infinities) or E5M2 (max 57344), scaled per tensor or per
block (DeepSeek-style 128×128 blocks). Scales are fp32 = amax / format max, so each block's largest magnitude
lands on the format's largest value; values round to nearest even and saturate at the format's max.

Built on torchao's float8 affine primitives (`_choose_scale_float8`, `_quantize_affine_float8`,
`_dequantize_affine_float8`), which take the block shape as an argument; a block shape must divide the tensor's.
torchao gives an all-zero block the scale 0 (and 0/0 on the way back): it gets scale 1 here, so it stays zero.
"""

from __future__ import annotations

import torch
from torchao.quantization import quant_primitives as qp

from miles_sync.formats import QuantizationError, Quantized

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def quantize(
    x: torch.Tensor, name: str = "tensor", dtype: str = "e4m3", block: tuple[int, int] | None = None
) -> Quantized:
    """Per-tensor scaling when `block` is None, else one scale per `block` (rows × columns)."""
    fp8 = DTYPES[dtype]
    rows, cols = x.shape
    shape = [rows, cols] if block is None else list(block)
    if rows % shape[0] or cols % shape[1]:
        raise QuantizationError(f"{name}: shape {tuple(x.shape)} is not a whole number of {shape[0]}×{shape[1]} blocks")
    scale = qp._choose_scale_float8(x, shape, fp8)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    data = qp._quantize_affine_float8(x, scale, fp8)
    fmt = "fp8" if block is None else "fp8_block"
    return Quantized(fmt, data, (scale,), x.shape, {"dtype": dtype, "block": tuple(shape)})


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return qp._dequantize_affine_float8(q.data, q.scales[0], dtype)
