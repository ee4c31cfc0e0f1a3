"""What a job's runs record, step by step: steps, per-stage spans, metrics, events and a sample of generations."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, func, select

from miles_control.service.store.base import StoreBase
from miles_control.service.store.models import Event, GenerationSample, Metric, Span, Step


class RecordTables(StoreBase):
    """The steps, spans, metrics, events and generation-sample tables."""

    # --- writes -------------------------------------------------------------------------------
    def add_step(self, job_id: int, step: int, weight_version: int, started_at: float, ended_at: float) -> None:
        """Record a finished step with the weight version it ended on."""
        with self.writing(job_id) as s:
            s.add(
                Step(job_id=job_id, step=step, weight_version=weight_version, started_at=started_at, ended_at=ended_at)
            )

    def add_spans(self, job_id: int, spans: Iterable[dict[str, Any]]) -> None:
        """Record timed spans (stage, step, worker, start, end, tokens, attrs)."""
        with self.writing(job_id) as s:
            s.add_all([Span(job_id=job_id, **span) for span in spans])

    def add_metrics(self, job_id: int, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of a step, stamped with the wall time now."""
        now = time.time()
        with self.writing(job_id) as s:
            s.add_all(
                [Metric(job_id=job_id, step=step, name=k, value=float(v), wall_time=now) for k, v in metrics.items()]
            )

    def add_event(
        self, job_id: int, kind: str, message: str, step: int | None = None, data: dict | None = None
    ) -> None:
        """Record an event of the job (of a step, with structured data)."""
        with self.writing(job_id) as s:
            s.add(Event(job_id=job_id, kind=kind, message=message, step=step, data=data or {}))

    def add_samples(self, job_id: int, step: int, samples: Iterable[dict[str, Any]]) -> None:
        """Record a sample of a step's generations."""
        with self.writing(job_id) as s:
            s.add_all([GenerationSample(job_id=job_id, step=step, **sample) for sample in samples])

    def discard_from(self, job_id: int, step: int) -> int:
        """Delete what steps ≥ `step` recorded (steps, spans, metrics, samples): a resumed attempt redoes them
        from its checkpoint. Events stay (they tell what happened). Returns the number of rows deleted."""
        deleted = 0
        with self.writing(job_id) as s:
            for table in (Step, Span, Metric, GenerationSample):
                result = s.execute(delete(table).where(table.job_id == job_id, table.step >= step))
                deleted += result.rowcount or 0
        return deleted

    # --- reads --------------------------------------------------------------------------------
    def metric_series(self, job_id: int, name: str) -> list[tuple[int, float]]:
        """(step, value) of one metric, by step."""
        return [(m.step, m.value) for m in self.metrics(job_id, [name])]

    def metrics(
        self, job_id: int, names: list[str] | None = None, step_min: int | None = None, step_max: int | None = None
    ) -> list[Metric]:
        """A job's metrics (of `names`, in a step range) by name and step."""
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
        """The names of the metrics a job recorded, sorted."""
        with self.session() as s:
            return list(s.scalars(select(Metric.name).where(Metric.job_id == job_id).distinct().order_by(Metric.name)))

    def spans(
        self, job_id: int, stage: str | None = None, step_min: int | None = None, step_max: int | None = None
    ) -> list[Span]:
        """A job's spans (of a stage, in a step range) by start time."""
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
        """A job's steps in order."""
        with self.session() as s:
            return list(s.scalars(select(Step).where(Step.job_id == job_id).order_by(Step.step)))

    def last_step(self, job_id: int) -> int | None:
        """The job's latest recorded step, if any."""
        return self.last_steps([job_id]).get(job_id)

    def last_steps(self, job_ids: list[int]) -> dict[int, int]:
        """The latest recorded step of each job that has one."""
        with self.session() as s:
            query = select(Step.job_id, func.max(Step.step)).where(Step.job_id.in_(job_ids)).group_by(Step.job_id)
            return {job_id: step for job_id, step in s.execute(query)}

    def events(self, job_id: int, after_id: int = 0, limit: int | None = None) -> list[Event]:
        """A job's events after `after_id`, oldest first (at most `limit`)."""
        query = select(Event).where(Event.job_id == job_id, Event.id > after_id).order_by(Event.id)
        if limit is not None:
            query = query.limit(limit)
        with self.session() as s:
            return list(s.scalars(query))

    def samples(self, job_id: int, step: int | None = None, limit: int = 100) -> list[GenerationSample]:
        """A job's recorded generations (of one step), newest step first."""
        query = select(GenerationSample).where(GenerationSample.job_id == job_id)
        if step is not None:
            query = query.where(GenerationSample.step == step)
        with self.session() as s:
            return list(s.scalars(query.order_by(GenerationSample.step.desc(), GenerationSample.id).limit(limit)))
