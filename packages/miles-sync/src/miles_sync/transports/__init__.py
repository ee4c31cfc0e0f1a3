"""The transport registry: the only place that maps a transport's name to its module.

Each transport module holds both halves and declares them as one typed `Transport` (`transports/base.py`):
its sender (a `BucketedSender`), `read(handle)` (the buckets of a published version, read in this process),
`receive(handle, engine)` (loads a version into an engine through the capabilities it offers, see
`miles_sync.protocol`) and, where every trainer rank publishes a part, `combine`. Adding a transport is one module
and one line here.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_sync.config import SyncConfig
from miles_sync.protocol import LoadsTensors, WeightSender
from miles_sync.transports import broadcast, disk, inproc, p2p, tensor
from miles_sync.transports.base import Transport
from miles_sync.types import NamedTensor, WeightHandle

_REGISTRY: dict[str, Transport] = {m.TRANSPORT.name: m.TRANSPORT for m in (inproc, disk, tensor, broadcast, p2p)}

TRANSPORTS = tuple(_REGISTRY)


def transport(name: str) -> Transport:
    """The registered transport called `name`; ValueError naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(_REGISTRY)}") from None


def needs_receiver_ranks(config: SyncConfig) -> bool:
    """Whether the sender of `config` must know how many receiving ranks the engines bring (`receiver_ranks`)
    before it is built: a collective group's size. The others are built without asking."""
    return bool(transport(config.transport).sender.needs_receiver_ranks)


def build_sender(config: SyncConfig, receiver_ranks: int = 1) -> WeightSender:
    """The sender of `config.transport`; `receiver_ranks`: how many receiving ranks the engines bring (see
    `needs_receiver_ranks`)."""
    sender: WeightSender = transport(config.transport).sender(config, receiver_ranks)
    return sender


def sends_from_every_rank(config: SyncConfig) -> bool:
    """Whether every trainer rank builds a sender and publishes what it holds (`combine` merges the handles)."""
    return bool(transport(config.transport).sender.from_every_rank)


def combine(handles: list[WeightHandle | None]) -> WeightHandle:
    """One version's handle from what each trainer rank's `publish` returned (None: a rank without a sender)."""
    given = [h for h in handles if h is not None]
    if not given:
        raise ValueError("no trainer rank published a handle")
    joins = transport(given[0].transport).combine
    if joins is None:
        if len(given) == 1:
            return given[0]
        raise ValueError(f"transport {given[0].transport!r} publishes from rank 0 only, got {len(given)} handles")
    return joins(given)


def read_buckets(handle: WeightHandle) -> Iterator[list[NamedTensor]]:
    """Yield the buckets of a published version in this process, whatever transport published it."""
    return transport(handle.transport).read(handle)


def receive(handle: WeightHandle, engine: LoadsTensors) -> None:
    """Load the version of `handle` into `engine` through its transport's receiver. The engine's capabilities
    (`LoadsFolder`, `JoinsGroup`) decide how; every engine offers `load_tensors`."""
    if not isinstance(engine, LoadsTensors):
        raise TypeError(f"{type(engine).__name__} cannot take weights: it has no load_tensors(handle, buckets)")
    transport(handle.transport).receive(handle, engine)
