"""The weight contract shared by rollout and training: one Protocol per side."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from miles_sync.types import NamedTensors, WeightHandle


@runtime_checkable
class WeightSender(Protocol):
    """Publishes a full set of named tensors (HF names) under a weight version."""

    name: str

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
