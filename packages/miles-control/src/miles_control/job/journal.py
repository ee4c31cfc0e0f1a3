"""What the loop needs from a job's record, as protocols: the loop writes and reads through them, the store
(miles_control.service.store.Store) implements them, and the loop never imports the service side.

The loop is `run`, `recorder`, `runtime/`, `schedules/`, `placement`, `preflight` and `convert`; the service is
`store/`, `api/`, `launch/` and `client` (tests/test_architecture.py checks the direction). The job's lifecycle
states and the refusal of a move they do not allow live in miles_control.job.status, which both sides import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from miles_control.job.status import JobStatus


class JobRow(Protocol):
    """A job as the loop reads it."""

    @property
    def spec(self) -> dict[str, Any]: ...

    @property
    def cancel_requested(self) -> bool: ...


class AttemptRow(Protocol):
    """One run of a job (its first, or a resume)."""

    @property
    def id(self) -> int: ...

    @property
    def number(self) -> int: ...

    @property
    def resume_step(self) -> int | None: ...


class CheckpointRow(Protocol):
    """A checkpoint the job saved."""

    @property
    def step(self) -> int: ...

    @property
    def path(self) -> str: ...


class ScheduleChangeRow(Protocol):
    """A change of live schedule fields, queued while the job runs."""

    @property
    def id(self) -> int: ...

    @property
    def patch(self) -> dict[str, Any]: ...


class RunRecords(Protocol):
    """Where a job's spans, metrics, events, steps, checkpoints and samples go as they happen."""

    def add_spans(self, job_id: int, spans: Iterable[dict[str, Any]]) -> None: ...

    def add_metrics(self, job_id: int, step: int, metrics: dict[str, float]) -> None: ...

    def add_event(
        self, job_id: int, kind: str, message: str, step: int | None = None, data: dict | None = None
    ) -> None: ...

    def add_step(self, job_id: int, step: int, weight_version: int, started_at: float, ended_at: float) -> None: ...

    def add_checkpoint(self, job_id: int, step: int, weight_version: int, path: str) -> None: ...

    def prune_checkpoints(self, job_id: int, keep: int) -> list[str]: ...

    def add_samples(self, job_id: int, step: int, samples: Iterable[dict[str, Any]]) -> None: ...

    def job(self, job_id: int) -> JobRow: ...

    def pending_schedule_changes(self, job_id: int) -> Sequence[ScheduleChangeRow]: ...

    def resolve_schedule_change(self, change_id: int, status: str, step: int | None, message: str) -> None: ...


class JobJournal(RunRecords, Protocol):
    """RunRecords and the job's lifecycle: its row, its attempts, its checkpoints, and rolling records back."""

    def create_job(self, name: str, spec: dict[str, Any], source: str = ..., status: JobStatus = ...) -> int: ...

    def set_status(
        self, job_id: int, status: JobStatus, error: str | None = None, expect: JobStatus | None = None
    ) -> None: ...

    def start_attempt(self, job_id: int, launcher: str, **fields: Any) -> AttemptRow: ...

    def fenced(self, attempt_id: int) -> JobJournal: ...

    def attempts(self, job_id: int | None = None, live_only: bool = False) -> Sequence[AttemptRow]: ...

    def update_attempt(self, attempt_id: int, **fields: Any) -> None: ...

    def end_attempt(self, attempt_id: int, reason: str) -> None: ...

    def checkpoints(self, job_id: int) -> Sequence[CheckpointRow]: ...

    def last_checkpoint(self, job_id: int) -> CheckpointRow | None: ...

    def discard_from(self, job_id: int, step: int) -> int: ...
