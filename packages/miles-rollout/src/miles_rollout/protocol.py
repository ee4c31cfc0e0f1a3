"""The RolloutEngine protocol: what every generation backend offers the rollout manager."""

from __future__ import annotations

import traceback
from typing import Protocol, runtime_checkable

from miles_rollout.config import PauseMode
from miles_rollout.types import GenerateRequest, GenerateResult
from miles_sync import WeightHandle


class WeightPushError(RuntimeError):
    """A push that broke off while an engine received it: the transport's stream or a server failed (a version the
    engine refuses whole raises ValueError instead, naming the engine too). The message names the engine, the
    version and what it still serves; the failure itself is `__cause__`."""

    def __init__(self, engine: str, weight_version: int, held: str, cause: BaseException | str) -> None:
        what = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"{engine}: receiving weight version {weight_version} failed ({what}); {held}")
        self.engine, self.weight_version, self.held, self.cause_text = engine, weight_version, held, what
        if isinstance(cause, BaseException):
            release_frames(cause)

    def __reduce__(self):  # through Ray (pickle): the same type and message; the cause travels as its text
        return (WeightPushError, (self.engine, self.weight_version, self.held, self.cause_text))


def release_frames(exc: BaseException) -> None:
    """Drop the locals of the frames a failure unwound (a transport's buffers, a collective group's pending
    receives) now, not whenever the error is freed: gloo aborts the process that frees them after their group."""
    traceback.clear_frames(exc.__traceback__)


@runtime_checkable
class RolloutEngine(Protocol):
    """Token-in/token-out generation that also receives weights (a `miles_sync.WeightReceiver`).

    `generate` is async and batched. `pause(mode)` stops decoding: `in_place` and `retract` hold
    in-flight requests until `resume()`, `abort` ends them with finish reason `abort`.

    What only some engines offer is a capability below (`AbortsRequests`, `LimitsCalls`, `ReleasesMemory`,
    `TimesPushPhases`): callers ask with `isinstance`, as miles_sync's receivers ask an engine for theirs.
    """

    name: str
    # Whether `receive`'s fingerprint is of the weights that serve generation (the hf engine's own model; SGLang's
    # servers, checked against their checksums with verify_weights), rather than of a copy the engine keeps: only
    # then is a push's weight check a measurement.
    verifies_loads: bool

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

    def receive(self, handle: WeightHandle, check_later: bool = False) -> str:
        """Load the published weights, take their version, return the fingerprint now held (through
        `miles_sync.receive(handle, loader)`: the transport's receiver calls the loader's `load_tensors`, or a
        capability of `miles_sync.protocol` the loader offers). No engine looks at the handle's transport.
        A version refused whole raises ValueError; a push that breaks off raises `WeightPushError`, naming the
        engine and the version it still serves. `check_later`: the caller checks once generation has resumed
        (`weight_fingerprint()`), so the engine skips its check now (returning "") and keeps the previous version
        until the next receive, for `roll_back()`."""
        ...

    def roll_back(self) -> int:
        """Back to the version held before the last `receive(..., check_later=True)` (SGLang: reloaded into every
        server and verified); returns that version. RuntimeError when no previous version is kept."""
        ...

    def drop_previous(self) -> None:
        """The check after `receive(..., check_later=True)` passed: free the previous version kept for it."""
        ...

    def weight_fingerprint(self) -> str: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class AbortsRequests(Protocol):
    """An engine that ends chosen requests while the others go on (finish reason `abort`, with what they generated so
    far). `EngineClient.abort_outstanding` uses it for dynamic sampling's surplus; an engine without it lets the
    surplus finish, and the manager discards it."""

    async def abort_requests(self, request_ids: list[str]) -> None:
        """End these requests now; the others go on."""
        ...


@runtime_checkable
class LimitsCalls(Protocol):
    """An engine that serves at most `max_concurrent_calls` `generate()` calls at once (the hf engine decodes one
    batch at a time): `EngineClient` gathers the calls that arrive meanwhile into the next batch. An engine without
    it serves any number of concurrent calls and batches them itself (SGLang)."""

    max_concurrent_calls: int


def call_limit(engine: RolloutEngine) -> int | None:
    """The `generate()` calls `engine` serves at once; None: any number."""
    return engine.max_concurrent_calls if isinstance(engine, LimitsCalls) else None


@runtime_checkable
class ReleasesMemory(Protocol):
    """An engine that gives its GPU memory (weights and KV cache) back while a colocated trainer steps, and takes it
    again before the next push (`resources.mode: colocated`; the engine config's `releases_memory` says so before
    anything starts)."""

    def release_memory(self) -> None:
        """Give the GPU memory of weights and KV cache back (before the trainer steps)."""
        ...

    def resume_memory(self) -> None:
        """Take the memory back (before weights are loaded and generation goes on)."""
        ...


@runtime_checkable
class TimesPushPhases(Protocol):
    """An engine that times the inside of a push's phases (waiting to pause, the servers' load, the check), summed
    into `push_phases` (seconds per phase) until the caller clears it for the next push."""

    push_phases: dict[str, float]
