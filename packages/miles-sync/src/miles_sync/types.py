"""Data that crosses the trainer/engine boundary."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NamedTensor = tuple[str, "torch.Tensor"]
NamedTensors = Iterable[NamedTensor]


@dataclass(frozen=True)
class WeightHandle:
    """What a sender returns and a receiver loads from: one published weight version.

    `fingerprint` is the sender's fingerprint of exactly the tensors it published, so the
    receiver (or anyone) can check equality after loading.
    """

    transport: str
    weight_version: int
    num_tensors: int
    num_bytes: int
    num_buckets: int
    fingerprint: str
    dtype: str | None = None
    """The dtype floating-point tensors were cast to before sending (`sync.dtype`); None: sent as given.
    A receiver that holds a wider dtype reports its fingerprint in this one, so the check compares like with
    like."""
    packed: str | None = None
    """The format whose packed bytes and scales the quantized weights travel in (`sync.quant_wire: packed`); None:
    every tensor is plain values. A receiver must hold that packed layout (miles_sync.formats.packed)."""
    base_version: int | None = None
    """A delta push (`sync.delta`): the version it changes. Only the tensors that differ from it travel
    (`num_tensors` and `num_bytes` count them, `unchanged_tensors` the others); `fingerprint` is of the whole new
    version. None: every tensor travels."""
    unchanged_tensors: int = 0
    location: str | None = None  # disk: the folder holding the buckets
    buckets: list[list[NamedTensor]] | None = field(default=None, repr=False)  # inproc: the tensors
    payloads: list[str] | None = field(default=None, repr=False)  # tensor: serialized shared-memory buckets
    group: dict | None = None  # broadcast: rendezvous of the process group (address, port, name, size)
    layout: list[list[tuple[str, str, list[int]]]] | None = field(default=None, repr=False)
    """broadcast: per bucket, the (name, dtype, shape) of each tensor, in broadcast order."""
