"""The job store: SQLAlchemy models and a small API over them."""

from miles_control.store.models import Base, Event, Job, JobStatus, Metric, Span, Step
from miles_control.store.store import Store

__all__ = ["Base", "Event", "Job", "JobStatus", "Metric", "Span", "Step", "Store"]
