"""Blocking HTTP calls to the SGLang servers of one engine, shared by its pause, weight and recovery parts
(generation uses its own asynchronous client: see `dispatch.py`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from miles_rollout.engines.sglang.router import Router, Slot


class ServerCalls:
    """`post` a JSON body to one server; errors name the server, the path and its answer."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.client = httpx.Client(timeout=timeout_s)

    def post(self, url: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        response = self.client.post(f"{url}{path}", json=body or {}, timeout=timeout or self.timeout_s)
        if response.status_code >= 400:
            raise RuntimeError(f"sglang engine {url}{path} answered {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else {}

    def close(self) -> None:
        self.client.close()


def tp_size(slot: Slot) -> int:
    """Tensor-parallel ranks of the slot's server (1 for a server attached by URL)."""
    return 1 if slot.server is None else slot.server.tp_size


def on_admitted(slots: list[Slot], router: Router, work: Callable[[Slot], object], what: str) -> None:
    """Run `work(slot)` on every admitted server in parallel; a transport failure quarantines that server,
    any other error is raised."""
    admitted = [s for s in slots if s.admitted]
    with ThreadPoolExecutor(max_workers=max(1, len(admitted))) as pool:
        futures = {slot: pool.submit(work, slot) for slot in admitted}
    for slot, future in futures.items():
        exc = future.exception()
        if isinstance(exc, httpx.TransportError):
            router.quarantine(slot, f"{what} failed: {type(exc).__name__}")
        elif exc is not None:
            raise exc
