"""MXFP8 (OCP Microscaling v1.0): blocks of 32 consecutive elements along the last dimension share one E8M0 scale
(a power of two); the elements are FP8 E4M3. The shared exponent is floor(log2(block amax)) − 8 (E4M3's largest
exponent), so a block's largest magnitude maps into [256, 512) and values above 448 saturate at 448, as the
specification allows. An all-zero block has scale 2^-127 and dequantizes to zeros.

Built on torchao's `MXTensor.to_mx` (emulated kernels: runs on CPU)."""

from __future__ import annotations

import torch
from torchao.prototype.mx_formats.mx_tensor import MXTensor

from miles_sync.formats import QuantizationError, Quantized

BLOCK = 32


def quantize(x: torch.Tensor, name: str = "tensor") -> Quantized:
    if x.shape[-1] % BLOCK:
        raise QuantizationError(
            f"{name}: MXFP8 needs the last dimension to be a multiple of {BLOCK}; got {tuple(x.shape)}"
        )
    mx = MXTensor.to_mx(x, torch.float8_e4m3fn, BLOCK)
    return Quantized("mxfp8", mx.qdata, (mx.scale,), x.shape)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    exponent = q.scales[0].view(torch.uint8).to(torch.int32) - 127  # E8M0: a biased power of two
    scale = torch.pow(2.0, exponent.float())
    values = q.data.float().reshape(*q.shape[:-1], -1, BLOCK) * scale.reshape(*q.shape[:-1], -1, 1)
    return values.reshape(q.shape).to(dtype)
