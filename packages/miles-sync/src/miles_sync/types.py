"""Data that crosses the trainer/engine boundary.

A published version is described by a handle: the fields every transport fills (`WeightHandle`) plus what its
own receiver needs, in one class per transport (`InprocHandle`, `DiskHandle`, `TensorHandle`,
`BroadcastHandle`). `AnyHandle` is their union; `transport` tells them apart (a literal per class).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Union

if TYPE_CHECKING:
    import torch

NamedTensor = tuple[str, "torch.Tensor"]
NamedTensors = Iterable[NamedTensor]
BucketLayout = list[tuple[str, str, list[int]]]
"""Per tensor of a bucket, in order: (name, dtype name, shape)."""


@dataclass(frozen=True, kw_only=True)
class WeightHandle:
    """What a sender returns and a receiver loads from: one published weight version (the fields every
    transport's handle has; each transport adds its own in a subclass).

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
    pieces: dict[str, list[tuple[int, int]]] | None = None
    """Tensors that several senders held in row ranges (`p2p` from sharded trainer ranks): per name, the ranges
    `fingerprint` hashed separately. A receiver computes its fingerprint the same way
    (`weight_fingerprint(..., pieces=handle.pieces)`). None: every tensor hashed whole."""


@dataclass(frozen=True, kw_only=True)
class InprocHandle(WeightHandle):
    """inproc: the tensors themselves, bucket by bucket."""

    transport: Literal["inproc"] = "inproc"
    buckets: list[list[NamedTensor]] = field(repr=False)


@dataclass(frozen=True, kw_only=True)
class DiskHandle(WeightHandle):
    """disk: the version folder (safetensors or zstd buckets and a manifest)."""

    transport: Literal["disk"] = "disk"
    location: str
    compression: str = "none"
    """How the buckets are written (`sync.compression`): none (safetensors files a server can read) or zstd."""


@dataclass(frozen=True, kw_only=True)
class TensorHandle(WeightHandle):
    """tensor: per bucket, its tensors serialized as shared-memory (CUDA IPC on GPU) handles."""

    transport: Literal["tensor"] = "tensor"
    payloads: list[str] = field(repr=False)
    ready_timeout_s: float = 120.0
    """How long a receiver waits for a bucket the sender is still copying (`sync.pipeline`)."""


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where and how the ranks of a `broadcast` weight group meet (rank 0: the sender)."""

    master_address: str
    master_port: int
    group_name: str
    world_size: int
    backend: str
    timeout_s: float


@dataclass(frozen=True, kw_only=True)
class BroadcastHandle(WeightHandle):
    """broadcast: the group the buckets are broadcast in and, per bucket, its tensors in broadcast order."""

    transport: Literal["broadcast"] = "broadcast"
    group: Rendezvous
    layout: list[BucketLayout] = field(repr=False)


PieceLayout = list[tuple[str, str, list[int], str, int, list[int]]]
"""Per piece of a `p2p` bucket, in order: (key, dtype name, shape, tensor name, first row, the tensor's full
shape). A whole tensor is one piece keyed by its name; a row shard is keyed `name[start:stop]`."""


@dataclass(frozen=True, kw_only=True)
class SenderPart:
    """What one `p2p` sender rank sends: its buckets' layouts, its bytes and its pieces' digests."""

    rank: int
    layout: list[PieceLayout] = field(repr=False)
    num_bytes: int
    digests: dict[str, bytes] = field(repr=False)


@dataclass(frozen=True, kw_only=True)
class P2PHandle(WeightHandle):
    """p2p: the group (senders are ranks 0..num_senders-1, receivers the ranks after them) and what each sender
    rank sends. A rank's own `publish` returns a handle with its part only; `miles_sync.combine` merges every
    rank's into the one the engines receive."""

    transport: Literal["p2p"] = "p2p"
    group: Rendezvous
    num_senders: int
    parts: list[SenderPart] = field(repr=False)
    max_buckets_in_flight: int = 8
    """How many buckets a receiving rank has receives posted for at once (`sync.max_buckets_in_flight`)."""


AnyHandle = Union[InprocHandle, DiskHandle, TensorHandle, BroadcastHandle, P2PHandle]  # noqa: UP007
