"""Pausing the servers for a weight push, resuming them, and the calls every live server gets."""

from __future__ import annotations

import time

import httpx

from miles_rollout.config import PauseMode
from miles_rollout.engines.sglang.calls import ServerCalls
from miles_rollout.engines.sglang.router import Router, Slot


class PauseControl:
    """Holds new calls and pauses the servers with requests in flight; `mode` is the pause in force (None
    when running), which decides whether a weight push may flush the prefix cache."""

    def __init__(self, slots: list[Slot], router: Router, calls: ServerCalls) -> None:
        self.slots, self.router, self.calls = slots, router, calls
        self.mode: PauseMode | None = None
        self.probe_wait_s = 0.0  # how long the last pause waited for a health probe in progress

    def each_live(self, path: str, body: dict | None = None) -> None:
        """POST to every server that may be running, quarantined ones included (a paused server must get its
        resume). A failure quarantines an admitted server and is ignored for one already quarantined."""
        for slot in self.slots:
            if slot.server is not None and not slot.server.alive():
                continue
            try:
                self.calls.post(slot.url, path, body, timeout=60)
            except (httpx.HTTPError, RuntimeError) as exc:
                if slot.admitted:
                    if not isinstance(exc, httpx.TransportError):
                        raise
                    self.router.quarantine(slot, f"{path} failed: {type(exc).__name__}")

    def pause(self, mode: PauseMode) -> None:
        """Stop new calls; pause (with `mode`) the servers that have requests in flight.

        A server with nothing in flight is left running: a load then waits for anything SGLang itself has
        running (its health probe), and its prefix cache can be flushed."""
        busy = [s for s in self.slots if s.outstanding > 0 and (s.server is None or s.server.alive())]
        began = time.monotonic()
        # A probe still queued in a paused server keeps SGLang from flushing the cache after the load; only an abort
        # flushes then (in_place and retract keep their requests, and flush once idle: see cache_flush_flag).
        self.router.hold(wait_for_probe=bool(busy) and mode == "abort")
        self.probe_wait_s = time.monotonic() - began
        self.mode = mode
        for slot in busy:
            try:
                self.calls.post(slot.url, "/pause_generation", {"mode": mode}, timeout=60)
                slot.paused = True
            except httpx.TransportError as exc:
                self.router.quarantine(slot, f"/pause_generation failed: {type(exc).__name__}")

    def resume(self) -> None:
        for slot in [s for s in self.slots if s.paused]:
            slot.paused = False
            try:
                self.calls.post(slot.url, "/continue_generation", timeout=60)
            except (httpx.HTTPError, RuntimeError) as exc:
                if slot.admitted:
                    self.router.quarantine(slot, f"/continue_generation failed: {exc}")
        self.mode = None
        self.router.release_hold()

    def cache_flush_flag(self, slot: Slot, last: bool = True) -> dict:
        """The `flush_cache` field of a weight-load call, and the slot marked when its flush must wait.

        The last bucket flushes the prefix cache: entries computed under the old weights must not be reused.
        Under an in_place or retract pause with requests in flight SGLang cannot flush (in_place requests keep
        their KV cache and continue on the new weights; retracted ones wait in its queue, and SGLang refuses to
        flush while any is queued); the slot is then marked `stale_cache` and flushed as soon as it is idle (see
        `dispatch.py`). An abort leaves nothing in flight, and flushes."""
        if not last:
            return {"flush_cache": False}
        flush = not (slot.paused and self.mode != "abort")
        slot.stale_cache = not flush
        return {"flush_cache": flush}
