"""Group tensors into buckets of bounded size, so a transfer never holds the whole model twice."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from miles_sync.types import NamedTensor, NamedTensors

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def wire_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a `sync.dtype` name; None (and an unresolved "auto") send tensors as given."""
    return None if name in (None, "auto") else _DTYPES[name]


def cast_for_wire(named_tensors: NamedTensors, dtype: torch.dtype | None) -> Iterator[NamedTensor]:
    """Detach, move to CPU and cast floating tensors to `dtype` (integers are left alone)."""
    for name, tensor in named_tensors:
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor.contiguous()


def iter_buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Yield lists of tensors whose total size stays within `bucket_bytes`.

    A single tensor larger than the limit gets a bucket of its own rather than being split:
    receivers load whole parameters.
    """
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
