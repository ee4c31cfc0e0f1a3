"""The bounded buffer of the `fully_async` schedule and its staleness rule (pure logic, no Ray).

Rollout workers `put` finished groups (all samples of one prompt) tagged with every weight version
any of their samples was generated under. The trainer `take`s groups oldest first; a group whose
staleness, `trainer_version - oldest version`, exceeds `max_staleness` is never handed out: it is
dropped, or handed back for regeneration, and counted. The same class runs in the rollout actor and
in the schedule simulation that the property tests drive with random stage timings.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

StalePolicy = Literal["drop", "regenerate"]


@dataclass
class Group:
    """One prompt's samples. `versions`: every engine weight version its samples spanned."""

    group_id: int
    prompt: Any
    samples: list[Any]
    versions: list[int]
    finished_at: float = 0.0

    @property
    def oldest(self) -> int:
        return min(self.versions)

    def staleness(self, trainer_version: int) -> int:
        """`Sample.staleness` of its stalest sample (`versions` is the union of the samples' weight versions)."""
        return trainer_version - self.oldest


@dataclass
class Taken:
    groups: list[Group] = field(default_factory=list)
    dropped: list[Group] = field(default_factory=list)  # too stale, discarded
    regenerate: list[Group] = field(default_factory=list)  # too stale, their prompts go back to be generated


class StalenessBuffer:
    """Thread-safe bounded FIFO of groups with the staleness rule applied at `take`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be at least 1 group, got {capacity}")
        self.capacity = capacity
        self._groups: deque[Group] = deque()
        self._cond = threading.Condition()
        self.num_dropped = 0
        self.num_regenerated = 0

    def __len__(self) -> int:
        return len(self._groups)

    def resize(self, capacity: int) -> None:
        """New capacity, effective for the next `put` (groups already in are kept)."""
        if capacity < 1:
            raise ValueError(f"buffer capacity must be at least 1 group, got {capacity}")
        with self._cond:
            self.capacity = capacity
            self._cond.notify_all()

    def put(self, group: Group, timeout: float | None = None) -> bool:
        """Add a finished group, waiting for room; False if there was none within `timeout`."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._groups) < self.capacity, timeout):
                return False
            self._groups.append(group)
            self._cond.notify_all()
            return True

    def take(
        self,
        num_groups: int,
        trainer_version: int,
        max_staleness: int,
        policy: StalePolicy = "drop",
        timeout: float | None = 0.0,
    ) -> Taken:
        """Up to `num_groups` fresh groups, oldest first; waits up to `timeout` for enough of them.

        Stale groups met on the way are removed and reported, never returned.
        """
        out = Taken()
        with self._cond:
            while True:
                while self._groups and len(out.groups) < num_groups:
                    group = self._groups.popleft()
                    if group.staleness(trainer_version) > max_staleness:
                        if policy == "regenerate":
                            out.regenerate.append(group)
                            self.num_regenerated += 1
                        else:
                            out.dropped.append(group)
                            self.num_dropped += 1
                    else:
                        out.groups.append(group)
                self._cond.notify_all()  # room was made
                if len(out.groups) >= num_groups or timeout == 0.0:
                    return out
                if not self._cond.wait(timeout):
                    return out
