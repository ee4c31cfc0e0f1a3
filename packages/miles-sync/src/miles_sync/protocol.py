"""The weight contract shared by rollout and training: one Protocol per side, and the capabilities an engine
offers the transports' receivers.

Every engine can take a version as tensors in its own process (`LoadsTensors`). An engine whose servers can
fetch a version themselves says so with a further capability, and a transport's receiver uses it when present:
servers that read a checkpoint folder (`LoadsFolder`, used by `disk`), servers that join a collective group
(`JoinsGroup`, used by `broadcast`). Engines never look at which transport a handle came from: they call
`miles_sync.receive(handle, self)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

from miles_sync.types import BroadcastHandle, DiskHandle, NamedTensor, NamedTensors, WeightHandle

Buckets = Iterator[list[NamedTensor]]


@runtime_checkable
class WeightSender(Protocol):
    """Publishes a full set of named tensors (HF names) under a weight version."""

    name: str
    from_every_rank: bool
    """True: every trainer rank publishes what it holds (`TrainerBackend.export_shards`) and the rank handles are
    merged (`miles_sync.combine`); False: rank 0 publishes full tensors (`export_weights`)."""

    def publish(self, named_tensors: NamedTensors, weight_version: int) -> WeightHandle: ...

    def wait(self) -> None:
        """Block until the last published version reached the receivers; raise if sending failed."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Anything that loads published weights (a rollout engine, a checker)."""

    @property
    def weight_version(self) -> int: ...

    def receive(self, handle: WeightHandle) -> str:
        """Load the weights of `handle`, take its version, and return the fingerprint now held."""
        ...


@runtime_checkable
class LoadsTensors(Protocol):
    """An engine that takes a version as tensors read in its own process (every engine)."""

    name: str

    def load_tensors(self, handle: WeightHandle, buckets: Buckets) -> None:
        """Take the version `handle` describes from `buckets` (all of them, or a delta push's changed tensors).
        Tensors that are in shared memory may be handed on to other processes as they are."""
        ...


@runtime_checkable
class LoadsFolder(Protocol):
    """An engine whose servers read a published version folder themselves (`disk`)."""

    def load_folder(self, handle: DiskHandle, buckets: Buckets) -> None:
        """Have the servers load `handle.location`; `buckets` is this process's read of the same tensors."""
        ...


@runtime_checkable
class JoinsGroup(Protocol):
    """An engine whose servers join the sender's collective group themselves (`broadcast`)."""

    def receiver_ranks(self) -> int:
        """How many receiving ranks the engine brings: itself and every server rank."""
        ...

    def join_group(self, handle: BroadcastHandle, receive_as: Callable[[int], Buckets]) -> None:
        """Have the servers take their ranks in `handle.group` (from 2 on) while this process takes rank 1 with
        `receive_as(1)` (and the rank of a server that cannot, with `receive_as(rank)`)."""
        ...
