"""The weight-version bookkeeping both engines share: the version held, and the one a push replaced.

A push received with `check_later` keeps the version it replaced (with the engine's snapshot of it) until its
check passes (`drop_previous`) or fails (`roll_back`); a push that breaks off once the engine took its version
gives that snapshot back (`failed`), so the engine can reinstate it. What a snapshot holds is the engine's
business: the overwritten parameters (hf), the copy of the version its servers were loaded from (sglang).
"""

from __future__ import annotations

from typing import Generic, TypeVar

Snapshot = TypeVar("Snapshot")


class WeightVersions(Generic[Snapshot]):
    """The version an engine holds, and around a push the version before it with the engine's snapshot of it."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._keep = False  # the push under way was received with check_later
        self._held = version  # the version held when the push under way began
        self._previous: tuple[int, Snapshot] | None = None

    @property
    def keeps_previous(self) -> bool:
        """Whether the push under way keeps the version it replaces (for `roll_back`) once it succeeds."""
        return self._keep

    def begin(self, check_later: bool) -> None:
        """A push starts: what an earlier push kept is dropped (its check is over), and this one keeps the version it
        replaces when its check comes later (`check_later`)."""
        self._keep, self._held, self._previous = check_later, self.version, None

    def took(self, version: int, replaced: Snapshot | None) -> None:
        """The engine holds `version` now; `replaced`: its snapshot of the version before (None: it kept none)."""
        if replaced is not None:
            self._previous = (self.version, replaced)
        self.version = version

    def failed(self) -> Snapshot | None:
        """The push broke off: the version held before it is the current one again. Returns the engine's snapshot
        of it when the push had already taken its version (the engine reinstates it), else None."""
        replaced = None if self._previous is None else self._previous[1]
        self.version, self._previous = self._held, None
        return replaced

    def done(self) -> None:
        """The push succeeded: the version it replaced is kept only when its check comes later."""
        if not self._keep:
            self._previous = None

    def roll_back(self, engine: str) -> tuple[int, Snapshot]:
        """Back to the version kept by the last push (`check_later`): it is the current one again. Returns it with
        the engine's snapshot; RuntimeError naming `engine` when none is kept."""
        if self._previous is None:
            raise RuntimeError(f"{engine}: no previous version is kept (receive with check_later=True)")
        (self.version, replaced), self._previous = self._previous, None
        return self.version, replaced

    def drop_previous(self) -> None:
        """The check after a `check_later` push passed: the version kept for it goes."""
        self._previous = None
