"""Live schedule parameters: changes requested while a job runs, applied at step boundaries."""

from __future__ import annotations

import threading
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from miles_control.job.recorder import Recorder
from miles_control.spec.config import ScheduleBase


class JobCancelled(Exception):
    """The job was cancelled (its `cancel_requested` flag, or a signal to its driver)."""


# Set by a driver's SIGINT handler. A handler must not raise: inside a Ray call the exception would
# surface as a SystemError; the loop stops at its next step boundary instead.
STOP_REQUESTED = threading.Event()


S = TypeVar("S", bound=ScheduleBase)


class LiveSchedule(Generic[S]):
    """The schedule a loop reads each step; `apply_pending(step)` takes in queued changes.

    A change may only touch the live fields of the schedule's type (`live_fields()`) and must leave a valid schedule;
    otherwise it is rejected with the reason. Either way the outcome is recorded: the change row gets
    its status and step, and an event `schedule_change` (or `schedule_change_rejected`) names the step.
    """

    def __init__(self, config: S, recorder: Recorder) -> None:
        self.config: S = config
        self.recorder = recorder

    def apply_pending(self, step: int) -> list[dict[str, Any]]:
        """Apply every queued change before `step` runs; returns the applied patches.

        Also where a cancelled job stops: a cancel requested through the API ends it before `step`."""
        store, job_id = self.recorder.store, self.recorder.job_id
        if STOP_REQUESTED.is_set() or store.job(job_id).cancel_requested:
            raise JobCancelled(f"cancel requested; stopped before step {step}")
        applied = []
        for change in store.pending_schedule_changes(job_id):
            problem = self._check(change.patch, self.config.live_fields())
            if problem is None:
                try:
                    updated = type(self.config).model_validate({**self.config.model_dump(), **change.patch})
                except ValidationError as exc:
                    problem = "; ".join(
                        f"{'.'.join(map(str, e['loc'])) or 'schedule'}: {e['msg']}" for e in exc.errors()
                    )
            if problem is not None:
                store.resolve_schedule_change(change.id, "rejected", step, problem)
                self.recorder.event("schedule_change_rejected", problem, step=step, patch=change.patch)
                continue
            before = {k: getattr(self.config, k) for k in change.patch}
            self.config = updated
            store.resolve_schedule_change(change.id, "applied", step, f"applied before step {step}")
            self.recorder.event(
                "schedule_change",
                ", ".join(f"{k}: {before[k]} → {v}" for k, v in change.patch.items()),
                step=step,
                patch=change.patch,
                before=before,
            )
            applied.append(change.patch)
        return applied

    def _check(self, patch: Any, live: tuple[str, ...]) -> str | None:
        if not isinstance(patch, dict) or not patch:
            return "a schedule change must be a non-empty mapping of field to value"
        fixed = sorted(set(patch) - set(live))
        if fixed:
            return (
                f"cannot change {', '.join(fixed)} while the job runs; live fields of {self.config.type}: "
                f"{', '.join(live)}"
            )
        return None
