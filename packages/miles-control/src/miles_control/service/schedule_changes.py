"""Requests to change a running job's live schedule fields: validated against the job and queued in the store.

The service side of live schedules (the API's `PATCH /jobs/{id}/schedule` and `miles schedule set`); the loop takes
the queued changes in at its step boundaries (`schedules/control.py:LiveSchedule`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from miles_control.service.store import ACTIVE, JobStatus
from miles_control.spec.config import SCHEDULES
from miles_control.spec.load import format_validation_error


class ScheduleChangeError(ValueError):
    """A requested change that cannot be queued; `conflict` when the job is not active (the API's 409)."""

    def __init__(self, message: str, conflict: bool = False) -> None:
        super().__init__(message)
        self.conflict = conflict


def queue_schedule_change(store: Any, job_id: int, patch: dict[str, Any]) -> int:
    """Validate a change of live schedule fields against the job and queue it; the change's id.

    The one check the API (`PATCH /jobs/{id}/schedule`) and `miles schedule set` share: only live fields,
    at least one, an active job, and the patched schedule still valid (e.g. max_staleness against
    update_weights_interval). Raises `ScheduleChangeError` naming the problem (and the store's
    `JobNotFound` for an unknown job)."""
    job = store.job(job_id)
    stored = job.spec.get("schedule", {})
    kind = stored.get("type", "sync")
    live = SCHEDULES[kind].live_fields()
    unknown = sorted(set(patch) - set(live))
    if unknown:
        raise ScheduleChangeError(
            f"{', '.join(unknown)}: not a live field of a {kind} schedule (live: {', '.join(live)})"
        )
    if not patch:
        raise ScheduleChangeError(f"give at least one of {', '.join(live)}")
    if JobStatus(job.status) not in ACTIVE:
        raise ScheduleChangeError(f"job {job_id} is {job.status}; only an active job's schedule can change", True)
    try:
        SCHEDULES[kind].model_validate({**stored, **patch})
    except ValidationError as exc:
        raise ScheduleChangeError("; ".join(format_validation_error(exc, {**stored, **patch}))) from None
    return store.request_schedule_change(job_id, patch)
