"""A job's lifecycle: its states, which moves between them are allowed, and the refusal of one that is not.

Both sides use it: the store enforces the moves (miles_control.service.store), and the loop (`run`) asks for them.
"""

from __future__ import annotations

import enum


class JobStatus(str, enum.Enum):
    """Where a job is in its lifecycle."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
ACTIVE = frozenset({JobStatus.QUEUED, JobStatus.STARTING, JobStatus.RUNNING})
# The job lifecycle. A resume is the only way out of a final state: failed | cancelled → queued.
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.QUEUED: frozenset({JobStatus.STARTING, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.STARTING: frozenset({JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.RUNNING: frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset({JobStatus.QUEUED}),
    JobStatus.CANCELLED: frozenset({JobStatus.QUEUED}),
}


class InvalidTransition(ValueError):
    """A lifecycle change the job's current status does not allow."""

    def __init__(self, job_id: int, current: str, wanted: str) -> None:
        allowed = sorted(s.value for s in TRANSITIONS[JobStatus(current)])
        super().__init__(
            f"job {job_id} is {current}; it cannot become {wanted} "
            f"(from {current}: {', '.join(allowed) if allowed else 'no further change'})"
        )
        self.job_id, self.current, self.wanted = job_id, current, wanted


class FencedOut(RuntimeError):
    """A write by a driver whose attempt no longer owns its job: the attempt was ended (judged lost, or replaced by
    a resume) or a newer attempt exists. The store refuses it, so two drivers never write one job's records."""

    def __init__(self, job_id: int, attempt_id: int, why: str) -> None:
        super().__init__(f"job {job_id}: attempt {attempt_id} no longer owns the job ({why}); its writes are refused")
        self.job_id, self.attempt_id = job_id, attempt_id
