"""Tables of the job store: jobs and their attempts, steps, per-stage spans, metrics, events,
checkpoints, schedule changes, a sample of generations, API tokens, and bench reports.

The schema is owned by the Alembic migrations in `store/migrations/`; a test checks that these models
and the migrations agree."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from miles_control.job.status import JobStatus


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    # Column types the annotations imply, where SQLAlchemy's own defaults do not fit: aware timestamps, JSON,
    # and FLOAT (the migrations' type; SQLAlchemy 2.1 would take DOUBLE).
    type_annotation_map = {datetime: DateTime(timezone=True), dict: JSON, list: JSON, float: Float}


class JobRecord:
    """The columns of every row that belongs to one job: its own id and its job's, deleted with the job."""

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), default=JobStatus.QUEUED.value)
    spec: Mapped[dict]
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # Added by migration 0002 (the control plane).
    source: Mapped[str] = mapped_column(String(20), default="cli", server_default="cli")  # cli | api
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    updated_at: Mapped[datetime | None] = mapped_column(default=utcnow)

    __table_args__ = (Index("ix_jobs_status", "status"),)


class Attempt(JobRecord, Base):
    """One launch of a job: the first run, then one per resume. Says where its driver runs."""

    __tablename__ = "attempts"

    number: Mapped[int]
    launcher: Mapped[str] = mapped_column(String(20))  # local | ray_job | inline
    resume_step: Mapped[int] = mapped_column(default=0)  # the checkpoint step it starts after
    driver_pid: Mapped[int | None]
    driver_host: Mapped[str | None] = mapped_column(String(255), nullable=True)
    submission_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    log_path: Mapped[str | None] = mapped_column(Text, nullable=True)
    status: Mapped[str] = mapped_column(String(20), default="starting")  # starting | running | ended
    exit_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]

    __table_args__ = (Index("ix_attempts_job_number", "job_id", "number", unique=True),)


class Checkpoint(JobRecord, Base):
    """A trainer checkpoint (weights + optimizer) a failed or cancelled job resumes from."""

    __tablename__ = "checkpoints"

    step: Mapped[int]
    weight_version: Mapped[int]
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (Index("ix_checkpoints_job_step", "job_id", "step"),)


class GenerationSample(JobRecord, Base):
    """A few generations of a step, as text, for people to read (the trainer keeps token ids)."""

    __tablename__ = "samples"

    step: Mapped[int]
    prompt: Mapped[str] = mapped_column(Text)
    response: Mapped[str] = mapped_column(Text)
    label: Mapped[str | None] = mapped_column(Text, nullable=True)
    reward: Mapped[float]
    status: Mapped[str] = mapped_column(String(20))
    weight_versions: Mapped[list] = mapped_column(default=list)
    num_tokens: Mapped[int | None]  # of the response
    logprobs: Mapped[list | None]  # the engine's, one per response token
    turns: Mapped[list | None]  # a multi-turn episode's messages {role, content}
    images: Mapped[list | None]  # the prompt's images, as PNG data URIs at most 256 px a side

    __table_args__ = (Index("ix_samples_job_step", "job_id", "step"),)


class Report(Base):
    """A bench report (`miles bench schedules|precision|algorithms|weights`): its markdown and the jobs it ran."""

    __tablename__ = "reports"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(40))  # schedules | precision | algorithms | weights
    title: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    markdown: Mapped[str] = mapped_column(Text)
    job_ids: Mapped[list] = mapped_column(default=list)


class ReportFile(Base):
    """A file a report shows (its PNG plots), by the name its markdown links."""

    __tablename__ = "report_files"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    report_id: Mapped[int] = mapped_column(ForeignKey("reports.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    data: Mapped[bytes] = mapped_column(LargeBinary)

    __table_args__ = (UniqueConstraint("report_id", "name", name="uq_report_files_name"),)


class ApiToken(Base):
    """A bearer token of the REST API. Only its SHA-256 is stored; the token is shown once."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    scope: Mapped[str] = mapped_column(String(20))  # read | admin
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))  # shown in listings to tell tokens apart
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class Step(JobRecord, Base):
    __tablename__ = "steps"

    step: Mapped[int]
    weight_version: Mapped[int]
    started_at: Mapped[float]  # unix seconds, like spans
    ended_at: Mapped[float]

    __table_args__ = (Index("ix_steps_job_step", "job_id", "step", unique=True),)


class Span(JobRecord, Base):
    """One stage of one step on one worker: rollout, reward, train, weight_sync, eval, ..."""

    __tablename__ = "spans"

    step: Mapped[int]
    stage: Mapped[str] = mapped_column(String(40))
    worker: Mapped[str] = mapped_column(String(80))
    start: Mapped[float]
    end: Mapped[float]
    num_tokens: Mapped[int] = mapped_column(default=0)
    num_bytes: Mapped[int] = mapped_column(default=0)
    attrs: Mapped[dict] = mapped_column(default=dict)

    __table_args__ = (Index("ix_spans_job_step", "job_id", "step"),)

    @property
    def duration(self) -> float:
        return self.end - self.start


class Metric(JobRecord, Base):
    __tablename__ = "metrics"

    step: Mapped[int]
    name: Mapped[str] = mapped_column(String(80))
    value: Mapped[float]
    wall_time: Mapped[float]

    __table_args__ = (Index("ix_metrics_job_name_step", "job_id", "name", "step"),)


class Event(JobRecord, Base):
    __tablename__ = "events"

    step: Mapped[int | None]
    kind: Mapped[str] = mapped_column(String(40))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (Index("ix_events_job_id", "job_id", "id"),)


class ScheduleChange(JobRecord, Base):
    """A requested change of a running job's live schedule fields; applied at a step boundary."""

    __tablename__ = "schedule_changes"

    patch: Mapped[dict]
    status: Mapped[str] = mapped_column(String(20), default="pending")  # pending | applied | rejected
    message: Mapped[str] = mapped_column(Text, default="")
    applied_step: Mapped[int | None]
    requested_at: Mapped[datetime] = mapped_column(default=utcnow)
