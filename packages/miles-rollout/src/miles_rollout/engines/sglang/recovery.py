"""Recovery of a quarantined server: restart it if its process is gone, then load the current weights if it
does not hold them, and verify. The router calls it from its health thread (with the engine's weight lock
held) and re-admits the server once it answers `/health_generate` again."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from miles_rollout.config import SGLangEngineConfig
from miles_rollout.engines.sglang.router import Slot
from miles_rollout.engines.sglang.server import SGLangServer, tail
from miles_rollout.engines.sglang.weights import WeightLoader, WeightMismatchError


@dataclass
class EngineRestart:
    """A server whose process was gone, started again: which one, why, and where each process logged (the crashed
    one's log is kept: a restarted server logs to a new file)."""

    index: int
    restart: int  # 1 for the server's first restart
    exit_code: int | None  # of the process that was gone (negative: the signal that ended it)
    reason: str  # why the router had quarantined the server
    crashed_log: str
    log: str  # the new process's
    at: float  # time.time() of the restart

    def describe(self) -> str:
        code = self.exit_code
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return (
            f"sglang server {self.index} {how}; restart {self.restart}, logging to {self.log} "
            f"(the crashed process's log: {self.crashed_log})"
        )


def recover(
    slot: Slot,
    config: SGLangEngineConfig,
    launch: Callable[[int, int], SGLangServer],
    weights: WeightLoader,
    version: int,
    on_restart: Callable[[EngineRestart], None] = lambda restart: None,
) -> None:
    """Bring `slot` back in sync with weight `version` (raises when it cannot; the router retries later).
    `launch(index, restart)` starts server `index` for its `restart`-th time; `on_restart` hears of each restart
    as it begins (the engine's owner records it)."""
    if slot.server is not None and not slot.server.alive():
        crashed = slot.server
        exit_code = crashed.process.poll()
        cause = crash_cause(crashed.log_path)
        again = slot.last_crash is not None and _signature(cause) == _signature(slot.last_crash)
        if again or slot.restarts >= config.max_restarts:
            # The same crash twice is the server's own failure (a missing kernel, a model it cannot run): a third
            # start would end alike. The restart budget is for failures that differ (a kill, an out-of-memory).
            why = "crashed the same way twice" if again else f"crashed after {slot.restarts} restarts"
            slot.given_up = f"sglang server {slot.index} {why}: {cause}\nlast lines of {crashed.log_path}:\n{tail(crashed.log_path, 12)}"
            raise RuntimeError(slot.given_up)
        slot.last_crash = cause
        crashed.stop()  # reap what is left of its process group
        weights.server_gone(slot)  # its shared files of a failed load can go now
        slot.restarts += 1
        slot.note(f"restarting (restart {slot.restarts} of at most {config.max_restarts})")
        slot.server = launch(slot.index, slot.restarts)
        on_restart(
            EngineRestart(
                slot.index, slot.restarts, exit_code, slot.reason.partition("\n")[0], str(crashed.log_path),
                str(slot.server.log_path), time.time(),
            )
        )  # fmt: skip
        slot.server.wait_ready(config.startup_timeout_s)
        slot.url = slot.server.url  # after: a server whose port was taken starts again on another
    try:
        weights.verify(slot, version)
    except WeightMismatchError:
        slot.note(f"loading weight version {version} before it serves again")
        weights.load_current(slot, version)
        weights.verify(slot, version)


_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b.*$")


def crash_cause(log_path: Path) -> str:
    """What a crashed server's log says ended it: its last exception line (`NotImplementedError: ...`), else its
    last line."""
    lines = [line.strip() for line in tail(log_path, 200).splitlines() if line.strip()]
    found = next((line for line in reversed(lines) if _EXCEPTION.match(line)), None)
    return (found or (lines[-1] if lines else "an empty log"))[:500]


def _signature(cause: str) -> str:
    """A crash's cause with what differs between two processes (numbers: pids, ports, addresses) left out."""
    return re.sub(r"0x[0-9a-f]+|\d+", "#", cause)
