"""Live schedule parameters: changes requested while a job runs, applied at step boundaries."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from miles_control.config import LIVE_SCHEDULE_FIELDS, ScheduleConfig
from miles_control.recorder import Recorder


class LiveSchedule:
    """The schedule a loop reads each step; `apply_pending(step)` takes in queued changes.

    A change may only touch the live fields (`LIVE_SCHEDULE_FIELDS`) and must leave a valid schedule;
    otherwise it is rejected with the reason. Either way the outcome is recorded: the change row gets
    its status and step, and an event `schedule_change` (or `schedule_change_rejected`) names the step.
    """

    def __init__(self, config: ScheduleConfig, recorder: Recorder) -> None:
        self.config = config
        self.recorder = recorder

    def apply_pending(self, step: int) -> list[dict[str, Any]]:
        """Apply every queued change before `step` runs; returns the applied patches."""
        store, job_id = self.recorder.store, self.recorder.job_id
        applied = []
        for change in store.pending_schedule_changes(job_id):
            problem = self._check(change.patch)
            if problem is None:
                try:
                    updated = ScheduleConfig.model_validate({**self.config.model_dump(), **change.patch})
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

    @staticmethod
    def _check(patch: Any) -> str | None:
        if not isinstance(patch, dict) or not patch:
            return "a schedule change must be a non-empty mapping of field to value"
        fixed = sorted(set(patch) - set(LIVE_SCHEDULE_FIELDS))
        if fixed:
            return (
                f"cannot change {', '.join(fixed)} while the job runs; live fields: {', '.join(LIVE_SCHEDULE_FIELDS)}"
            )
        return None
