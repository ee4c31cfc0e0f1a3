"""Transport factory: the only place that branches on the transport name."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from miles_sync.config import BroadcastSync, SyncConfig
from miles_sync.protocol import WeightSender
from miles_sync.transports.broadcast import BroadcastSender, read_broadcast
from miles_sync.transports.disk import DiskSender, read_disk
from miles_sync.transports.inproc import InprocSender, read_inproc
from miles_sync.transports.tensor import TensorSender, read_tensor
from miles_sync.types import NamedTensor, WeightHandle

_SENDERS: dict[str, type] = {
    "inproc": InprocSender,
    "disk": DiskSender,
    "tensor": TensorSender,
    "broadcast": BroadcastSender,
}
_READERS: dict[str, Callable[[WeightHandle], Iterator[list[NamedTensor]]]] = {
    "inproc": read_inproc,
    "disk": read_disk,
    "tensor": read_tensor,
    "broadcast": read_broadcast,
}

TRANSPORTS = tuple(_SENDERS)


def build_sender(config: SyncConfig, num_receivers: int = 1) -> WeightSender:
    """The sender of `config.transport`; `num_receivers` is the number of receiving ranks (broadcast only)."""
    if isinstance(config, BroadcastSync):
        return BroadcastSender(config, num_receivers)
    return _SENDERS[config.transport](config)


def read_buckets(handle: WeightHandle) -> Iterator[list[NamedTensor]]:
    """Yield the buckets of a published version, whatever transport published it."""
    try:
        reader = _READERS[handle.transport]
    except KeyError:
        raise ValueError(f"unknown transport {handle.transport!r}; known: {', '.join(_READERS)}") from None
    return reader(handle)
