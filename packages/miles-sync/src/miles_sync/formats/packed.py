"""Packed pushes: the linear weights travel as the format's own bytes and scales, for an engine that runs real
low-precision kernels on them (SGLang on a GPU), instead of as the dequantized values of the grid.

One format is packed: `fp8_block`, in the layout SGLang's `fp8` quantization method loads and hot-reloads
(DeepSeek-V3's checkpoint layout, which Miles' FP8 rollouts use): each quantized linear `X.weight` becomes
`X.weight` in float8_e4m3fn plus `X.weight_scale_inv`, fp32, one value per 128×128 block (the multiplier that
turns the fp8 values back into weights), and config.json carries

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

Why only that one: SGLang replaces the weights of the other layouts after loading (per-tensor fp8 is transposed
and its fused shards requantized to one scale; MXFP8 is converted to block fp8 on Hopper; NVFP4 and INT4 are
re-laid-out for their kernels), so a pushed update cannot be loaded into them in place. Those formats reach the
engines as values (`sync.quant_wire: values`), on a GPU as on a CPU.

`write_packed_checkpoint` turns an HF folder into the packed checkpoint the engine starts from, so that its
parameters already have the packed shapes and dtypes every later push loads into.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from miles_sync.bucketing import cast_for_wire
from miles_sync.formats import QuantizationError, Quantized, dequantize, quantizable, quantize
from miles_sync.types import NamedTensor, NamedTensors

PACKED_FORMATS = ("fp8_block",)
SCALE_SUFFIX = "_scale_inv"
BLOCK = 128


def check_packable(fmt: str) -> None:
    if fmt not in PACKED_FORMATS:
        raise QuantizationError(
            f"quantization {fmt!r} cannot travel packed: an engine loads packed updates in place only for "
            f"{', '.join(PACKED_FORMATS)} (see miles_sync.formats.packed); send it as values"
        )


def quantization_config(fmt: str) -> dict:
    """The `quantization_config` of config.json that makes SGLang build its parameters in `fmt`'s packed layout."""
    check_packable(fmt)
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def pack(name: str, tensor: torch.Tensor, fmt: str) -> list[NamedTensor]:
    """`name`'s packed tensors: the fp8 values under `name` and the block scales under `name` + `_scale_inv`."""
    check_packable(fmt)
    q = quantize(tensor.detach().cpu(), fmt, name=name)
    return [(name, q.data.contiguous()), (name + SCALE_SUFFIX, q.scales[0].float().contiguous())]


def packed_for_push(named_tensors: NamedTensors, fmt: str, dtype: torch.dtype | None) -> Iterator[NamedTensor]:
    """The stream of a packed push: quantizable weights packed (fp8 values + fp32 scales, never cast), every other
    floating tensor cast to the wire `dtype` (None: as given), all on CPU and contiguous."""
    for name, tensor in named_tensors:
        if quantizable(name, tensor.shape):
            yield from pack(name, tensor, fmt)
        else:
            yield from cast_for_wire([(name, tensor)], dtype)


def unpack(named_tensors: NamedTensors, fmt: str, dtype: torch.dtype = torch.float32) -> Iterator[NamedTensor]:
    """The inverse view: each packed weight and its scales as the weight's dequantized values in `dtype`, what an
    engine computes with; other tensors unchanged. Raises on a packed weight without its scales."""
    check_packable(fmt)
    tensors = dict(named_tensors)
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors.get(name + SCALE_SUFFIX)
            if scale is None:
                raise QuantizationError(f"{name}: packed fp8 weight without its {name + SCALE_SUFFIX}")
            q = Quantized(fmt, tensor, (scale,), tensor.shape, {"dtype": "e4m3", "block": (BLOCK, BLOCK)})
            yield name, dequantize(q, dtype)
        else:
            yield name, tensor


def write_packed_checkpoint(source: str | Path, target: str | Path, fmt: str) -> Path:
    """Write `source` (an HF folder) to `target` with its linear weights packed in `fmt` and config.json's
    `quantization_config` set; tokenizer and other files are copied. Returns `target`."""
    from safetensors.torch import load_file, save_file

    check_packable(fmt)
    source, target = Path(source), Path(target)
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise QuantizationError(f"packed checkpoint: no *.safetensors weights in {source}")
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".safetensors.index.json"):
            shutil.copy2(path, target / path.name)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(dict(packed_for_push(load_file(str(path)).items(), fmt, None)))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config(fmt)
    config_path.write_text(json.dumps(config, indent=2))
    return target
