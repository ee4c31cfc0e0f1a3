"""What the job's actors answer, typed: callers read fields, not tuple positions."""

from __future__ import annotations

from dataclasses import dataclass
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
