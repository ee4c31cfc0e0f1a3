"""A small API over the job store. Every write commits at once: what was recorded survives a crash."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, delete, event, func, select, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, InterfaceError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from miles_control.store.migrate import ensure_schema
from miles_control.store.models import (
    Attempt,
    Checkpoint,
    Event,
    GenerationSample,
    Job,
    JobStatus,
    Metric,
    Report,
    ReportFile,
    ScheduleChange,
    Span,
    Step,
    utcnow,
)

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


class JobNotFound(KeyError):
    def __init__(self, job_id: int) -> None:
        super().__init__(f"no job {job_id}")
        self.job_id = job_id

    def __str__(self) -> str:
        return self.args[0]


class InvalidTransition(ValueError):
    """A lifecycle change the job's current status does not allow."""

    def __init__(self, job_id: int, current: str, wanted: str) -> None:
        allowed = sorted(s.value for s in TRANSITIONS[JobStatus(current)])
        super().__init__(
            f"job {job_id} is {current}; it cannot become {wanted} "
            f"(from {current}: {', '.join(allowed) if allowed else 'no further change'})"
        )
        self.job_id, self.current, self.wanted = job_id, current, wanted


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


class StoreError(ValueError):
    """A store that cannot be opened: a URL of no known database, a server that does not answer, a file that
    cannot be created. The message names the URL (without its password) and the cause."""


def shown_url(url: str) -> str:
    """`url` as it may be printed: without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return repr(url)


def make_engine(url: str) -> Engine:
    try:
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, pool_pre_ping=not url.startswith("sqlite"))
    except (ArgumentError, NoSuchModuleError) as exc:
        raise StoreError(
            f"store {shown_url(url)}: not a database URL Miles can open ({exc}); use sqlite:///PATH or "
            "postgresql+psycopg://USER:PASSWORD@HOST/DB"
        ) from None
    except OSError as exc:
        raise StoreError(f"store {shown_url(url)}: cannot create its folder ({exc})") from None
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


class Store:
    """Jobs and everything their runs record: attempts, steps, spans, metrics, events, checkpoints, samples."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        try:
            ensure_schema(self.engine)
        except (OperationalError, InterfaceError) as exc:
            raise StoreError(
                f"store {shown_url(url)}: cannot open it ({' '.join(str(exc.orig or exc).split())})"
            ) from None
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self._sessions()

    # --- lifecycle ----------------------------------------------------------------------------
    def create_job(
        self, name: str, spec: dict[str, Any], source: str = "cli", status: JobStatus = JobStatus.QUEUED
    ) -> int:
        """A new job row; `miles run` creates its job `starting` (it runs it itself: no launcher may take it)."""
        with self.session() as s, s.begin():
            job = Job(name=name, spec=spec, status=status.value, source=source)
            s.add(job)
            s.flush()
            return job.id

    def set_status(
        self, job_id: int, status: JobStatus, error: str | None = None, expect: JobStatus | None = None
    ) -> None:
        """Move a job along its lifecycle; refuses what `TRANSITIONS` does not allow (InvalidTransition).

        Atomic between processes: the row changes only if its status is still the one the check saw
        (`UPDATE … WHERE status = …`). With `expect`, only from that status."""
        job = self.job(job_id)
        current = JobStatus(job.status)
        if status not in TRANSITIONS[current] or (expect is not None and current != expect):
            raise InvalidTransition(job_id, current.value, status.value)
        now = utcnow()
        values: dict[str, Any] = {"status": status.value, "updated_at": now}
        if status == JobStatus.RUNNING:
            values["started_at"] = now
        if status in FINAL:
            values["finished_at"] = now
        if status == JobStatus.QUEUED:  # a resume
            values.update(finished_at=None, error=None, cancel_requested=False)
        if error is not None:
            values["error"] = error
        message = f"{current.value} → {status.value}" + (f": {error}" if error else "")
        with self.session() as s, s.begin():
            changed = s.execute(
                update(Job).where(Job.id == job_id, Job.status == current.value).values(**values)
            ).rowcount
            if changed:
                s.add(Event(job_id=job_id, kind="status", message=message, data={"status": status.value}))
        if not changed:  # another process moved it first
            raise InvalidTransition(job_id, self.job(job_id).status, status.value)

    def request_cancel(self, job_id: int) -> str:
        """Cancel a job: at once when queued, else flag it for its driver. Returns the resulting status."""
        for _ in range(5):  # retried when the status changes under us
            current = JobStatus(self.job(job_id).status)
            if current not in ACTIVE:
                raise InvalidTransition(job_id, current.value, JobStatus.CANCELLED.value)
            values: dict[str, Any] = {"cancel_requested": True, "updated_at": utcnow()}
            if current == JobStatus.QUEUED:
                values.update(status=JobStatus.CANCELLED.value, finished_at=utcnow(), error="cancelled while queued")
            with self.session() as s, s.begin():
                query = update(Job).where(Job.id == job_id, Job.status == current.value).values(**values)
                if not s.execute(query).rowcount:
                    continue
                if current == JobStatus.QUEUED:
                    s.add(
                        Event(job_id=job_id, kind="status", message="queued → cancelled", data={"status": "cancelled"})
                    )
                else:
                    s.add(Event(job_id=job_id, kind="cancel", message="cancel requested", data={}))
                return values.get("status", current.value)
        raise InvalidTransition(job_id, self.job(job_id).status, JobStatus.CANCELLED.value)

    def resume(self, job_id: int) -> int:
        """failed | cancelled → queued; returns the step of the checkpoint the next attempt starts after."""
        self.set_status(job_id, JobStatus.QUEUED)
        last = self.last_checkpoint(job_id)
        return last.step if last is not None else 0

    def start_attempt(self, job_id: int, launcher: str, **fields: Any) -> Attempt:
        last = self.last_checkpoint(job_id)
        with self.session() as s, s.begin():
            number = (s.scalar(select(func.max(Attempt.number)).where(Attempt.job_id == job_id)) or 0) + 1
            attempt = Attempt(
                job_id=job_id,
                number=number,
                launcher=launcher,
                resume_step=last.step if last is not None else 0,
                status="starting",
                **fields,
            )
            s.add(attempt)
            s.flush()
            return attempt

    def update_attempt(self, attempt_id: int, **fields: Any) -> None:
        with self.session() as s, s.begin():
            s.execute(update(Attempt).where(Attempt.id == attempt_id).values(**fields))

    def end_attempt(self, attempt_id: int, reason: str) -> None:
        self.update_attempt(attempt_id, status="ended", exit_reason=reason, ended_at=utcnow())

    def discard_from(self, job_id: int, step: int) -> int:
        """Delete what steps ≥ `step` recorded (steps, spans, metrics, samples): a resumed attempt redoes them
        from its checkpoint. Events stay (they tell what happened). Returns the number of rows deleted."""
        deleted = 0
        with self.session() as s, s.begin():
            for table in (Step, Span, Metric, GenerationSample):
                result = s.execute(delete(table).where(table.job_id == job_id, table.step >= step))
                deleted += result.rowcount or 0
        return deleted

    # --- what runs record ---------------------------------------------------------------------
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

    def add_checkpoint(self, job_id: int, step: int, weight_version: int, path: str) -> None:
        with self.session() as s, s.begin():
            s.add(Checkpoint(job_id=job_id, step=step, weight_version=weight_version, path=path))

    def add_samples(self, job_id: int, step: int, samples: Iterable[dict[str, Any]]) -> None:
        with self.session() as s, s.begin():
            s.add_all([GenerationSample(job_id=job_id, step=step, **sample) for sample in samples])

    def add_report(
        self, kind: str, title: str, markdown: str, job_ids: list[int], files: dict[str, bytes] | None = None
    ) -> int:
        """Store a bench report with the files its markdown shows (its plots); returns its id."""
        with self.session() as s, s.begin():
            report = Report(kind=kind, title=title, markdown=markdown, job_ids=list(job_ids))
            s.add(report)
            s.flush()
            s.add_all([ReportFile(report_id=report.id, name=n, data=d) for n, d in (files or {}).items()])
            return report.id

    def reports(self, kind: str | None = None) -> list[Report]:
        """Every report (of `kind`), newest first."""
        with self.session() as s:
            query = select(Report) if kind is None else select(Report).where(Report.kind == kind)
            return list(s.scalars(query.order_by(Report.id.desc())))

    def report(self, report_id: int) -> Report | None:
        with self.session() as s:
            return s.get(Report, report_id)

    def report_files(self, report_id: int) -> list[str]:
        with self.session() as s:
            query = select(ReportFile.name).where(ReportFile.report_id == report_id).order_by(ReportFile.name)
            return list(s.scalars(query))

    def report_file(self, report_id: int, name: str) -> bytes | None:
        with self.session() as s:
            query = select(ReportFile.data).where(ReportFile.report_id == report_id, ReportFile.name == name)
            return s.scalars(query).first()

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
                raise JobNotFound(job_id)
            return job

    def jobs(
        self,
        status: list[str] | None = None,
        name: str | None = None,
        limit: int = 50,
        offset: int = 0,
        source: str | None = None,
    ) -> tuple[list[Job], int]:
        """Newest first, with the total count of matches (for pagination)."""
        query = select(Job)
        if source:
            query = query.where(Job.source == source)
        if status:
            query = query.where(Job.status.in_(status))
        if name:
            query = query.where(Job.name.contains(name, autoescape=True))
        with self.session() as s:
            total = s.scalar(select(func.count()).select_from(query.subquery()))
            rows = s.scalars(query.order_by(Job.id.desc()).limit(limit).offset(offset))
            return list(rows), int(total or 0)

    def attempts(self, job_id: int | None = None, live_only: bool = False) -> list[Attempt]:
        query = select(Attempt)
        if job_id is not None:
            query = query.where(Attempt.job_id == job_id)
        if live_only:
            query = query.where(Attempt.status != "ended")
        with self.session() as s:
            return list(s.scalars(query.order_by(Attempt.id)))

    def attempt(self, attempt_id: int) -> Attempt:
        with self.session() as s:
            attempt = s.get(Attempt, attempt_id)
            if attempt is None:
                raise KeyError(f"no attempt {attempt_id}")
            return attempt

    def checkpoints(self, job_id: int) -> list[Checkpoint]:
        with self.session() as s:
            return list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))

    def last_checkpoint(self, job_id: int) -> Checkpoint | None:
        checkpoints = self.checkpoints(job_id)
        return checkpoints[-1] if checkpoints else None

    def metric_series(self, job_id: int, name: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.metrics(job_id, [name])]

    def metrics(
        self, job_id: int, names: list[str] | None = None, step_min: int | None = None, step_max: int | None = None
    ) -> list[Metric]:
        # Plain rows, not ORM objects: curves are read often and whole.
        query = select(Metric.name, Metric.step, Metric.value, Metric.wall_time).where(Metric.job_id == job_id)
        if names:
            query = query.where(Metric.name.in_(names))
        if step_min is not None:
            query = query.where(Metric.step >= step_min)
        if step_max is not None:
            query = query.where(Metric.step <= step_max)
        with self.session() as s:
            return list(s.execute(query.order_by(Metric.name, Metric.step, Metric.id)))

    def metric_names(self, job_id: int) -> list[str]:
        with self.session() as s:
            return list(s.scalars(select(Metric.name).where(Metric.job_id == job_id).distinct().order_by(Metric.name)))

    def spans(
        self, job_id: int, stage: str | None = None, step_min: int | None = None, step_max: int | None = None
    ) -> list[Span]:
        query = select(Span).where(Span.job_id == job_id)
        if stage is not None:
            query = query.where(Span.stage == stage)
        if step_min is not None:
            query = query.where(Span.step >= step_min)
        if step_max is not None:
            query = query.where(Span.step <= step_max)
        with self.session() as s:
            return list(s.scalars(query.order_by(Span.start)))

    def steps(self, job_id: int) -> list[Step]:
        with self.session() as s:
            return list(s.scalars(select(Step).where(Step.job_id == job_id).order_by(Step.step)))

    def last_step(self, job_id: int) -> int | None:
        return self.last_steps([job_id]).get(job_id)

    def last_steps(self, job_ids: list[int]) -> dict[int, int]:
        with self.session() as s:
            query = select(Step.job_id, func.max(Step.step)).where(Step.job_id.in_(job_ids)).group_by(Step.job_id)
            return {job_id: step for job_id, step in s.execute(query)}

    def events(self, job_id: int, after_id: int = 0, limit: int | None = None) -> list[Event]:
        query = select(Event).where(Event.job_id == job_id, Event.id > after_id).order_by(Event.id)
        if limit is not None:
            query = query.limit(limit)
        with self.session() as s:
            return list(s.scalars(query))

    def samples(self, job_id: int, step: int | None = None, limit: int = 100) -> list[GenerationSample]:
        query = select(GenerationSample).where(GenerationSample.job_id == job_id)
        if step is not None:
            query = query.where(GenerationSample.step == step)
        with self.session() as s:
            return list(s.scalars(query.order_by(GenerationSample.step.desc(), GenerationSample.id).limit(limit)))

    def count_by_status(self) -> dict[str, int]:
        with self.session() as s:
            return {status: n for status, n in s.execute(select(Job.status, func.count()).group_by(Job.status))}
