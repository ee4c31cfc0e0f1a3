"""Recovery of a quarantined server: restart it if its process is gone, then load the current weights if it
does not hold them, and verify. The router calls it from its health thread (with the engine's weight lock
held) and re-admits the server once it answers `/health_generate` again."""

from __future__ import annotations

from collections.abc import Callable

from miles_rollout.config import SGLangEngineConfig
from miles_rollout.engines.sglang.router import Slot
from miles_rollout.engines.sglang.server import SGLangServer
from miles_rollout.engines.sglang.weights import WeightLoader, WeightMismatchError


def recover(
    slot: Slot, config: SGLangEngineConfig, launch: Callable[[int], SGLangServer], weights: WeightLoader, version: int
) -> None:
    """Bring `slot` back in sync with weight `version` (raises when it cannot; the router retries later)."""
    if slot.server is not None and not slot.server.alive():
        if slot.restarts >= config.max_restarts:
            raise RuntimeError(f"gave up after {slot.restarts} restarts; log {slot.server.log_path}")
        slot.server.stop()  # reap what is left of its process group
        weights.server_gone(slot)  # its shared files of a failed load can go now
        slot.restarts += 1
        slot.note(f"restarting (restart {slot.restarts} of at most {config.max_restarts})")
        slot.server = launch(slot.index)
        slot.server.wait_ready(config.startup_timeout_s)
        slot.url = slot.server.url  # after: a server whose port was taken starts again on another
    try:
        weights.verify(slot, version)
    except WeightMismatchError:
        slot.note(f"loading weight version {version} before it serves again")
        weights.load_current(slot, version)
        weights.verify(slot, version)
