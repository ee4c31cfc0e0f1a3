"""NVFP4: FP4 E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), blocks of 16 along the last dimension
with an FP8 E4M3 block scale, and an fp32 tensor scale amax / (6 × 448) that keeps the block scales inside E4M3's
range (an all-zero tensor gets tensor scale 1). Two values pack into a byte. Values round to nearest even on the E2M1 grid and saturate at ±6 × scale.

Built on torchao's `NVFP4Tensor.to_nvfp4` with `per_tensor_scale` (emulated kernels: runs on CPU)."""

from __future__ import annotations

import torch
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

from miles_sync.formats import QuantizationError, Quantized

BLOCK = 16


def quantize(x: torch.Tensor, name: str = "tensor") -> Quantized:
    if x.shape[-1] % BLOCK:
        raise QuantizationError(
            f"{name}: NVFP4 needs the last dimension to be a multiple of {BLOCK}; got {tuple(x.shape)}"
        )
    amax = x.abs().max()
    tensor_scale = per_tensor_amax_to_scale(amax) if amax > 0 else torch.tensor(1.0)  # all zero: any scale
    nv = NVFP4Tensor.to_nvfp4(x, block_size=BLOCK, per_tensor_scale=tensor_scale)
    return Quantized("nvfp4", nv.qdata, (nv.scale, tensor_scale.float().reshape(1)), x.shape)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    nv = NVFP4Tensor(q.data, q.scales[0], BLOCK, torch.float32, per_tensor_scale=q.scales[1].reshape(()))
    return nv.dequantize(dtype)
