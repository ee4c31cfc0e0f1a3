"""The RolloutEngine protocol: what every generation backend offers the rollout manager."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from miles_rollout.config import PauseMode
from miles_rollout.types import GenerateRequest, GenerateResult
from miles_sync import WeightHandle


@runtime_checkable
class RolloutEngine(Protocol):
    """Token-in/token-out generation that also receives weights (a `miles_sync.WeightReceiver`).

    `generate` is async and batched. `pause(mode)` stops decoding: `in_place` and `retract` hold
    in-flight requests until `resume()`, `abort` ends them with finish reason `abort`.
    """

    name: str

    @property
    def weight_version(self) -> int: ...

    def receiver_ranks(self) -> int:
        """How many receiving ranks this engine brings to a collective weight push (sender: rank 0)."""
        ...

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]: ...

    async def pause(self, mode: PauseMode = "in_place") -> None: ...

    async def resume(self) -> None: ...

    async def flush_cache(self) -> None: ...

    async def health(self) -> bool: ...

    def receive(self, handle: WeightHandle) -> str:
        """Load the published weights, take their version, return the fingerprint now held (through
        `miles_sync.receive(handle, loader)`: the transport's receiver calls the loader's `load_tensors`, or a
        capability of `miles_sync.protocol` the loader offers). No engine looks at the handle's transport."""
        ...

    def weight_fingerprint(self) -> str: ...

    def shutdown(self) -> None: ...
