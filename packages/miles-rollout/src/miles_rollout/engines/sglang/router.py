"""Router over N SGLang servers: least outstanding requests, health checks, quarantine, re-admission.

A `Slot` is one server position. The router hands out the admitted slot with the fewest requests in
flight. A background thread polls `/health_generate` on every slot; a slot that fails (or whose
process died, or whose request failed at the transport level) is quarantined: it gets no new work
and its in-flight requests are retried elsewhere by the caller. The owner's `recover(slot)` callback
then brings it back (restart if the process is gone, load the current weights, verify them) and the
slot is re-admitted once it answers `/health_generate` again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from miles_rollout.engines.sglang.server import SGLangServer

log = logging.getLogger(__name__)


class NoHealthyEngineError(RuntimeError):
    """No engine came back within the router's wait."""


@dataclass(eq=False)  # identity: slots are keys and are mutated
class Slot:
    index: int
    url: str
    server: SGLangServer | None = None  # None when attached by URL
    admitted: bool = True
    outstanding: int = 0
    reason: str = ""  # why it was quarantined
    restarts: int = 0
    stale_cache: bool = False  # holds prefix-cache entries of an older weight version
    served: int = 0  # generate calls completed
    answered_at: float = 0.0  # time.monotonic() of its last answered generate call
    paused: bool = False  # paused by the engine for a weight push (it had requests in flight)
    last_crash: str | None = None  # what ended its last crashed process (recovery.crash_cause)
    given_up: str | None = None  # why recovery stopped trying: the slot never serves again
    events: list[str] = field(default_factory=list)

    def note(self, message: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {message}")
        log.warning("sglang engine %d (%s): %s", self.index, self.url, message)


class Router:
    """Picks slots for requests and keeps them healthy; `recover(slot)` is called off the event loop."""

    def __init__(
        self,
        slots: list[Slot],
        recover: Callable[[Slot], None],
        health_interval_s: float,
        health_timeout_s: float,
        busy: threading.Lock,
    ) -> None:
        self.slots = slots
        self._recover = recover
        self._interval = health_interval_s
        self._timeout = health_timeout_s
        self._busy = busy  # held by weight updates: no health probes or recoveries meanwhile
        self.paused = False
        self._epoch = 0
        self._probing = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="miles-sglang-health", daemon=True)
        self._thread.start()

    @property
    def admitted(self) -> list[Slot]:
        return [s for s in self.slots if s.admitted]

    async def acquire(self, wait_s: float) -> Slot:
        """The admitted slot with the fewest requests in flight; waits up to `wait_s` for one."""
        deadline = time.monotonic() + wait_s
        while True:
            admitted = [] if self.paused else self.admitted  # no new calls start during a weight push
            if admitted:
                slot = min(admitted, key=lambda s: (s.outstanding, s.index))
                slot.outstanding += 1
                return slot
            if all(s.given_up for s in self.slots):  # none can come back: no point waiting out the deadline
                raise NoHealthyEngineError(
                    "no sglang server can serve: " + "; ".join(s.given_up or "" for s in self.slots)
                )
            if time.monotonic() > deadline:
                reasons = "; ".join(f"engine {s.index}: {s.reason}" for s in self.slots)
                raise NoHealthyEngineError(f"no healthy sglang engine for {wait_s:.0f} s ({reasons})")
            await asyncio.sleep(0.1)

    @staticmethod
    def release(slot: Slot) -> None:
        slot.outstanding -= 1

    def quarantine(self, slot: Slot, reason: str) -> None:
        if slot.admitted:
            slot.admitted = False
            slot.reason = reason
            slot.note(f"quarantined: {reason}")
        self._wake.set()  # recover now rather than at the next tick

    def _probe(self, slot: Slot) -> str | None:
        """None when healthy, else why not."""
        if slot.server is not None and not slot.server.alive():
            return f"process exited with code {slot.server.process.poll()}"
        try:
            response = httpx.get(f"{slot.url}/health_generate", timeout=self._timeout)
        except httpx.HTTPError as exc:
            return f"/health_generate failed: {type(exc).__name__}"
        return None if response.status_code == 200 else f"/health_generate answered {response.status_code}"

    def hold(self, wait_for_probe: bool) -> None:
        """A weight push begins: no new calls start and no probes run until `release_hold`.

        A probe is a one-token request: if it is still queued in a server that then pauses, SGLang refuses
        to flush the cache after the load. So when servers are about to be paused (`wait_for_probe`), a
        probe in progress (about a second: SGLang answers it after its first poll) is let finish first.
        """
        self.paused = True
        self._epoch += 1
        if wait_for_probe and self._probing.acquire(timeout=self._timeout + 5):
            self._probing.release()

    def release_hold(self) -> None:
        self.paused = False

    def check_now(self) -> None:
        """One round of health checks and recoveries (the thread's body; callable from tests)."""
        for slot in self.slots:
            if self._stop.is_set() or self.paused:
                return
            if self._answering(slot):
                continue  # busy and answering: its answers prove its health, and a probe would cost a push
            epoch = self._epoch
            with self._probing:
                if self.paused:
                    return
                problem = self._probe(slot)
            if self.paused or epoch != self._epoch:
                return  # a pause began during the probe: its answer says nothing about health
            if problem and slot.admitted:
                self.quarantine(slot, problem)
            elif not slot.admitted and self._busy.acquire(blocking=False):  # never during a weight update
                try:
                    self._try_recover(slot, problem)
                finally:
                    self._busy.release()

    def _answering(self, slot: Slot) -> bool:
        """An admitted server with calls in flight that answered one within the health interval needs no probe.

        SGLang answers `/health_generate` no sooner than a second after it arrives, and a weight push that pauses
        busy servers may wait for a probe in progress (see `hold`): under an asynchronous schedule, where servers
        are always busy, probing them cost a push 75-175 ms on average (docs/results.md). A server that stops answering
        is probed again once the interval has passed without an answer; one whose process exits is probed (and
        found dead) at once."""
        alive = slot.server is None or slot.server.alive()
        recent = time.monotonic() - slot.answered_at < self._interval
        return slot.admitted and alive and slot.outstanding > 0 and recent

    def _try_recover(self, slot: Slot, problem: str | None) -> None:
        if slot.given_up:
            return
        dead = slot.server is not None and not slot.server.alive()
        if problem and not dead:
            return  # alive but not answering (or attached by URL): wait until it answers again
        try:
            self._recover(slot)  # restarts a dead process, loads and verifies the current weights
        except Exception as exc:  # noqa: BLE001 - stays quarantined, retried at the next tick
            slot.reason = f"recovery failed: {exc}"
            slot.note(slot.reason)
            return
        if self._probe(slot) is None:
            slot.admitted, slot.reason = True, ""
            slot.note("re-admitted")

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if not self._stop.is_set():
                try:
                    self.check_now()
                except Exception:  # noqa: BLE001 - the health thread must not die
                    log.exception("sglang health check failed")

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
