"""A small API over the job store. Every write commits at once: what was recorded survives a crash.

`Store` is one object over every table; its methods live with their table family: `store/jobs.py` (jobs, their
lifecycle, attempts, checkpoints, schedule changes), `store/records.py` (steps, spans, metrics, events, samples)
and `store/bench_reports.py` (bench reports). Opening a store is `store/base.py`; the lifecycle's states and
moves are `miles_control.job.status`, re-exported here."""

from __future__ import annotations

from miles_control.job.status import ACTIVE, FINAL, TRANSITIONS, InvalidTransition
from miles_control.service.store.base import StoreError, make_engine, shown_url
from miles_control.service.store.bench_reports import ReportTables
from miles_control.service.store.jobs import AttemptConflict, JobNotFound, JobTables
from miles_control.service.store.records import RecordTables

__all__ = [
    "ACTIVE",
    "AttemptConflict",
    "FINAL",
    "TRANSITIONS",
    "InvalidTransition",
    "JobNotFound",
    "Store",
    "StoreError",
    "make_engine",
    "shown_url",
]


class Store(JobTables, RecordTables, ReportTables):
    """Jobs and everything their runs record: attempts, steps, spans, metrics, events, checkpoints, samples."""
