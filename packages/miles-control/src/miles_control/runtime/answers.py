"""What the job's actors answer, typed: callers read fields, not tuple positions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_sync import WeightHandle


@dataclass
class Timed:
    """When a call's work started and ended on the actor (unix seconds): the span the runtime records."""

    start: float
    end: float


@dataclass
class TrainResult(Timed):
    """A train step's span and its metrics (with the rank's CPU, memory and GPU use)."""

    metrics: dict[str, float]


@dataclass
class Published(Timed):
    """A rank's export and publish of a weight version."""

    handle: WeightHandle | None  # this rank's; None on a rank without a sender (the span: export and publish)


@dataclass
class Received(Timed):
    """The rollout side's receive of a weight version: pause, load, check (and roll-back), resume."""

    fingerprint: str  # of the weights the engine holds now
    weight_version: int
    paused_s: float = 0.0  # how long generation stood still: the load (and the check, or a roll-back)
    check_failure: str | None = None  # sync.check_after_resume: why the engine's check failed
    rolled_back_to: int | None = None  # ... and the version the engine went back to
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase of the push (summary.push_breakdown)
    # schedule.push_between_batches: when the push waited for the batch being generated to end (start, end)
    waited: tuple[float, float] | None = None
    checked: bool = True  # the fingerprint is of the weights that serve (RolloutEngine.verifies_loads)


@dataclass
class Evaluated(Timed):
    """An evaluation's span and its metrics."""

    metrics: dict[str, float]


@dataclass
class TakenBatch:
    """`take`'s answer: fresh groups as one batch, each sample's staleness, and what was discarded."""

    batch: Any
    staleness: list[int]
    dropped: int
    regenerated: int
    buffered: int
