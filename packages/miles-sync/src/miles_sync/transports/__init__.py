"""The transport registry: the only place that maps a transport's name to its module.

Each transport module holds both halves: `Sender` (a `BucketedSender`), `read(handle)` (the buckets of a
published version, read in this process) and `receive(handle, engine)` (loads a version into an engine through
the capabilities it offers, see `miles_sync.protocol`). Adding a transport is one module and one line here.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

from miles_sync.config import SyncConfig
from miles_sync.protocol import LoadsTensors, WeightSender
from miles_sync.transports import broadcast, disk, inproc, tensor
from miles_sync.types import NamedTensor, WeightHandle

_MODULES: dict[str, ModuleType] = {m.NAME: m for m in (inproc, disk, tensor, broadcast)}

TRANSPORTS = tuple(_MODULES)


def _module(transport: str) -> ModuleType:
    try:
        return _MODULES[transport]
    except KeyError:
        raise ValueError(f"unknown transport {transport!r}; known: {', '.join(_MODULES)}") from None


def needs_receiver_ranks(config: SyncConfig) -> bool:
    """Whether the sender of `config` must know how many receiving ranks the engines bring (`receiver_ranks`)
    before it is built: a collective group's size. The others are built without asking."""
    return bool(_module(config.transport).Sender.needs_receiver_ranks)


def build_sender(config: SyncConfig, receiver_ranks: int = 1) -> WeightSender:
    """The sender of `config.transport`; `receiver_ranks`: how many receiving ranks the engines bring (see
    `needs_receiver_ranks`)."""
    sender: WeightSender = _module(config.transport).Sender(config, receiver_ranks)
    return sender


def read_buckets(handle: WeightHandle) -> Iterator[list[NamedTensor]]:
    """Yield the buckets of a published version in this process, whatever transport published it."""
    return _module(handle.transport).read(handle)  # type: ignore[no-any-return]


def receive(handle: WeightHandle, engine: LoadsTensors) -> None:
    """Load the version of `handle` into `engine` through its transport's receiver. The engine's capabilities
    (`LoadsFolder`, `JoinsGroup`) decide how; every engine offers `load_tensors`."""
    if not isinstance(engine, LoadsTensors):
        raise TypeError(f"{type(engine).__name__} cannot take weights: it has no load_tensors(handle, buckets)")
    _module(handle.transport).receive(handle, engine)
