"""The weights as the engines hold them or as the forward uses them, for any backend's model: fake quantization to a
push's or training's grid, rounding to the pushed dtype, the share of an update the rounding lets through. Functions
over a model's parameters; the `Trainer` decides when they apply."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist


def param_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's part of every parameter as a plain tensor (the local shard of a DTensor: a view).

    FSDP2 modules are resharded first: a root module keeps its parameters unsharded after a forward, and their
    memory is freed at the next reshard, so only the sharded parameters are stable."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]


def dtensor_replicas(param: torch.Tensor, world_size: int) -> int:
    """How many ranks hold the local data of `param`: for a DTensor, the mesh dimensions it is replicated over; a
    plain tensor is on every rank."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return world_size
    return math.prod(param.device_mesh.size(i) for i, p in enumerate(placements) if p.is_replicate())


@contextlib.contextmanager
def weights_as(model: torch.nn.Module, quant: tuple[str, int] | None, dtype: torch.dtype | None) -> Iterator[None]:
    """For the duration, the parameters hold the master weights with the linear weights rounded to the grid of
    `quant` (format, int4 group) and everything rounded to `dtype`; afterwards the master weights are back, bit for
    bit. A backward inside gives the gradient at the rounded weights, which the optimizer applies to the master
    weights (a straight-through estimator, as mixed-precision training and QAT do). A no-op when both are None."""
    if quant is None and dtype is None:
        yield
        return
    shards = param_shards(model)
    with torch.no_grad():
        master = [p.detach().clone() for p in shards]
    try:
        with torch.no_grad():  # inside the try: a format that refuses a tensor leaves the master weights intact
            if quant is not None:
                fake_quantize(model, shards, *quant)
            if dtype is not None:
                for p in shards:
                    p.copy_(p.to(dtype))
        yield
    finally:
        with torch.no_grad():
            for p, m in zip(shards, master, strict=True):
                p.copy_(m)


def fake_quantize(model: torch.nn.Module, shards: list[torch.Tensor], fmt: str, group_size: int) -> None:
    """Round this rank's part of every linear weight to `fmt`'s grid, as the whole (HF-layout) tensor rounds.

    A sharded DTensor is gathered whole first (the scales of a tensor or of a block span ranks) and this rank keeps
    its slice: a collective that every rank runs in the same order. Plain tensors (megatron) round as they are; its
    config admits only the formats whose scales are local to a row's block (int4, mxfp8)."""
    from miles_sync import formats

    for (name, param), shard in zip(model.named_parameters(), shards, strict=True):
        if not formats.quantizable(name, param.shape):
            continue
        if hasattr(param, "full_tensor"):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            full = formats.fake_quantize(param.full_tensor(), fmt, group_size, name)
            shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
            part = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
            shard.copy_(part)
        else:
            shard.copy_(formats.fake_quantize(shard, fmt, group_size, name))


def update_kept(
    model: torch.nn.Module,
    before: list[torch.Tensor],
    push_dtype: torch.dtype,
    replicas: Callable[[torch.Tensor], int],
    device: Any,
) -> float:
    """Of the weights this step changed, the share whose pushed (rounded) value changed too (all ranks)."""
    changed = kept = 0.0
    shards = param_shards(model)  # reshards FSDP2 modules: parameters() below are the sharded ones
    with torch.no_grad():
        for param, p, old in zip(list(model.parameters()), shards, before, strict=True):
            moved = p != old
            share = 1.0 / replicas(param)
            changed += int(moved.sum()) * share
            kept += int((moved & (p.to(push_dtype) != old.to(push_dtype))).sum()) * share
    counts = torch.tensor([changed, kept], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    return float(counts[1] / counts[0]) if counts[0] > 0 else 1.0
