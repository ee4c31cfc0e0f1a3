"""The job store: SQLAlchemy models, Alembic migrations and a small API over them."""

from miles_control.store.models import (
    ApiToken,
    Attempt,
    Base,
    Checkpoint,
    Event,
    GenerationSample,
    Job,
    JobStatus,
    Metric,
    Report,
    ScheduleChange,
    Span,
    Step,
)
from miles_control.store.store import (
    ACTIVE,
    FINAL,
    TRANSITIONS,
    InvalidTransition,
    JobNotFound,
    Store,
    StoreError,
)

__all__ = [
    "ACTIVE",
    "FINAL",
    "TRANSITIONS",
    "ApiToken",
    "Attempt",
    "Base",
    "Checkpoint",
    "Event",
    "GenerationSample",
    "InvalidTransition",
    "Job",
    "JobNotFound",
    "JobStatus",
    "Metric",
    "Report",
    "ScheduleChange",
    "Span",
    "Step",
    "StoreError",
    "Store",
]
