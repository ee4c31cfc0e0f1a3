"""Transport factory: the only place that branches on the transport name."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from miles_sync.config import SyncConfig
from miles_sync.protocol import WeightSender
from miles_sync.transports.disk import DiskSender, read_disk
from miles_sync.transports.inproc import InprocSender, read_inproc
from miles_sync.types import NamedTensor, WeightHandle

_SENDERS: dict[str, type] = {"inproc": InprocSender, "disk": DiskSender}
_READERS: dict[str, Callable[[WeightHandle], Iterator[list[NamedTensor]]]] = {
    "inproc": read_inproc,
    "disk": read_disk,
}

TRANSPORTS = tuple(_SENDERS)


def build_sender(config: SyncConfig) -> WeightSender:
    return _SENDERS[config.transport](config)


def read_buckets(handle: WeightHandle) -> Iterator[list[NamedTensor]]:
    """Yield the buckets of a published version, whatever transport published it."""
    try:
        reader = _READERS[handle.transport]
    except KeyError:
        raise ValueError(f"unknown transport {handle.transport!r}; known: {', '.join(_READERS)}") from None
    return reader(handle)
