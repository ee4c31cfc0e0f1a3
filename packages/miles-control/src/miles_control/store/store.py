"""A small API over the job store. Every write commits at once: what was recorded survives a crash."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from miles_control.store.models import Base, Event, Job, JobStatus, Metric, ScheduleChange, Span, Step, utcnow

_FINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


class Store:
    """Jobs, steps, spans, metrics and events of runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        Base.metadata.create_all(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self._sessions()

    # --- writes -------------------------------------------------------------------------------
    def create_job(self, name: str, spec: dict[str, Any]) -> int:
        with self.session() as s, s.begin():
            job = Job(name=name, spec=spec, status=JobStatus.QUEUED.value)
            s.add(job)
            s.flush()
            return job.id

    def set_status(self, job_id: int, status: JobStatus, error: str | None = None) -> None:
        with self.session() as s, s.begin():
            job = s.get(Job, job_id)
            if job is None:
                raise KeyError(f"no job {job_id}")
            if JobStatus(job.status) in _FINAL:
                raise ValueError(f"job {job_id} is {job.status}; it cannot become {status.value}")
            job.status = status.value
            if status == JobStatus.RUNNING:
                job.started_at = utcnow()
            if status in _FINAL:
                job.finished_at = utcnow()
            if error is not None:
                job.error = error

    def add_step(self, job_id: int, step: int, weight_version: int, started_at: float, ended_at: float) -> None:
        with self.session() as s, s.begin():
            s.add(
                Step(job_id=job_id, step=step, weight_version=weight_version, started_at=started_at, ended_at=ended_at)
            )

    def add_spans(self, job_id: int, spans: Iterable[dict[str, Any]]) -> None:
        with self.session() as s, s.begin():
            s.add_all([Span(job_id=job_id, **span) for span in spans])

    def add_metrics(self, job_id: int, step: int, metrics: dict[str, float]) -> None:
        now = time.time()
        with self.session() as s, s.begin():
            s.add_all(
                [Metric(job_id=job_id, step=step, name=k, value=float(v), wall_time=now) for k, v in metrics.items()]
            )

    def add_event(
        self, job_id: int, kind: str, message: str, step: int | None = None, data: dict | None = None
    ) -> None:
        with self.session() as s, s.begin():
            s.add(Event(job_id=job_id, kind=kind, message=message, step=step, data=data or {}))

    def request_schedule_change(self, job_id: int, patch: dict[str, Any]) -> int:
        """Queue a change of live schedule fields; the running job applies it at its next step boundary."""
        self.job(job_id)  # unknown ids fail here, not silently later
        with self.session() as s, s.begin():
            change = ScheduleChange(job_id=job_id, patch=patch)
            s.add(change)
            s.flush()
            return change.id

    def pending_schedule_changes(self, job_id: int) -> list[ScheduleChange]:
        with self.session() as s:
            query = select(ScheduleChange).where(ScheduleChange.job_id == job_id, ScheduleChange.status == "pending")
            return list(s.scalars(query.order_by(ScheduleChange.id)))

    def resolve_schedule_change(self, change_id: int, status: str, step: int | None, message: str) -> None:
        with self.session() as s, s.begin():
            change = s.get(ScheduleChange, change_id)
            change.status, change.applied_step, change.message = status, step, message

    def schedule_changes(self, job_id: int) -> list[ScheduleChange]:
        with self.session() as s:
            query = select(ScheduleChange).where(ScheduleChange.job_id == job_id)
            return list(s.scalars(query.order_by(ScheduleChange.id)))

    # --- reads --------------------------------------------------------------------------------
    def job(self, job_id: int) -> Job:
        with self.session() as s:
            job = s.get(Job, job_id)
            if job is None:
                raise KeyError(f"no job {job_id}")
            return job

    def metric_series(self, job_id: int, name: str) -> list[tuple[int, float]]:
        with self.session() as s:
            rows = s.execute(
                select(Metric.step, Metric.value)
                .where(Metric.job_id == job_id, Metric.name == name)
                .order_by(Metric.step)
            )
            return [(step, value) for step, value in rows]

    def spans(self, job_id: int, stage: str | None = None) -> list[Span]:
        with self.session() as s:
            query = select(Span).where(Span.job_id == job_id)
            if stage is not None:
                query = query.where(Span.stage == stage)
            return list(s.scalars(query.order_by(Span.start)))

    def steps(self, job_id: int) -> list[Step]:
        with self.session() as s:
            return list(s.scalars(select(Step).where(Step.job_id == job_id).order_by(Step.step)))

    def events(self, job_id: int) -> list[Event]:
        with self.session() as s:
            return list(s.scalars(select(Event).where(Event.job_id == job_id).order_by(Event.id)))
