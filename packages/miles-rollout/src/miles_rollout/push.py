"""The engine side of a weight push, in one place: pause → receive → resume, the check (at once, or once
generation has resumed) and the roll-back of a failed one, each phase timed; and the one judgement of what the
engine holds against what the trainer sent (`Landed.matches`, `Landed.weights_match`).

The rollout actor (`miles_control.job.runtime.rollout_worker`), the in-process driver
(`miles_control.bench.inprocess`) and the benches (`bench/weight_update.py`, `bench/paused_load.py`) all push through
`land`; none pauses, loads or compares fingerprints itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles_rollout.config import PauseMode
from miles_rollout.protocol import RolloutEngine, TimesPushPhases
from miles_sync import WeightHandle


@dataclass
class Landed:
    """What a push did to an engine: when it ran (unix seconds), what the engine holds now, how long generation stood
    still, the phases' seconds, and whether the check compared the weights that serve."""

    start: float
    end: float
    fingerprint: str  # of the weights the engine holds now (after a roll-back: of the version it went back to)
    weight_version: int
    expected: str  # the trainer's fingerprint of the version pushed (handle.fingerprint)
    paused_s: float = 0.0  # generation stood still: the load (and the check, unless after resuming), a roll-back
    check_failure: str | None = None  # check_after_resume: why the check failed
    rolled_back_to: int | None = None  # ... and the version the engine went back to
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase: pause, load, resume, check, ...
    waited: tuple[float, float] | None = None  # a caller that first waited for a batch to end: (start, end)
    checked: bool = True  # the fingerprint is of the weights that serve (RolloutEngine.verifies_loads)

    @property
    def matches(self) -> bool:
        """The engine holds what the trainer sent: the fingerprints agree and no check failed."""
        return self.fingerprint == self.expected and self.check_failure is None

    @property
    def weights_match(self) -> bool | None:
        """`matches` where it is a measurement (the engine checked the weights that serve); None, unmeasured,
        where the fingerprint is of a copy the engine keeps."""
        return self.matches if self.checked else None


def land(
    engine: RolloutEngine, handle: WeightHandle, pause_mode: PauseMode = "in_place", check_after_resume: bool = False
) -> Landed:
    """Load the version of `handle` into `engine`: pause (`pause_mode`), receive (the engine loads and, unless
    `check_after_resume`, checks), resume. With `check_after_resume` the check runs once generation has resumed; the
    engine keeps the version it replaced until the check passes, and a failed check pauses again and rolls back.
    Call from a thread without a running event loop (each paused section runs its own)."""
    start = time.time()
    phases: dict[str, float] = {}
    inside = engine.push_phases if isinstance(engine, TimesPushPhases) else None
    if inside is not None:
        inside.clear()  # summed over this push's pauses (a roll-back pauses again)

    def timed(phase: str, began: float) -> float:
        now = time.time()
        phases[phase] = phases.get(phase, 0.0) + now - began
        return now

    async def paused(work: Callable[[], Any], phase: str) -> Any:
        began = time.time()
        await engine.pause(pause_mode)
        began = timed("pause", began)
        try:
            return work()
        finally:
            began = timed(phase, began)
            await engine.resume()
            timed("resume", began)

    fingerprint = asyncio.run(paused(lambda: engine.receive(handle, check_later=check_after_resume), "load"))
    paused_s = time.time() - start
    failure, rolled_back_to = None, None
    if check_after_resume:
        began = time.time()
        try:
            fingerprint = engine.weight_fingerprint()
            if fingerprint != handle.fingerprint:
                failure = f"engine fingerprint {fingerprint}, trainer {handle.fingerprint}"
        except Exception as exc:  # noqa: BLE001 - SGLang: a server's checksums differ; reported, then rolled back
            failure = f"{type(exc).__name__}: {exc}"
        timed("check", began)
        if failure is None:
            engine.drop_previous()
        else:
            back = time.time()
            try:
                rolled_back_to = asyncio.run(paused(engine.roll_back, "roll_back"))
                fingerprint = engine.weight_fingerprint()
            except Exception as exc:
                raise RuntimeError(
                    f"the weight check after resuming failed for version {handle.weight_version} ({failure}), "
                    f"and rolling the engine back failed too: {type(exc).__name__}: {exc}"
                ) from exc
            paused_s += time.time() - back
    phases |= inside or {}  # SGLang: waiting for a health probe, pausing the servers, the server check
    return Landed(
        start, time.time(), fingerprint, engine.weight_version, handle.fingerprint, paused_s, failure,
        rolled_back_to, phases, checked=engine.verifies_loads,
    )  # fmt: skip
