"""Jobs and what controls them: the lifecycle (the moves `miles_control.job.status` allows, made atomic here),
attempts, checkpoints (where a resumed attempt starts) and queued changes of a running job's schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from miles_control.job.status import ACTIVE, FINAL, TRANSITIONS, InvalidTransition, JobStatus
from miles_control.service.store.base import StoreBase
from miles_control.service.store.models import Attempt, Checkpoint, Event, Job, ScheduleChange, utcnow


class JobNotFound(KeyError):
    """No job of that id in the store."""

    def __init__(self, job_id: int) -> None:
        super().__init__(f"no job {job_id}")
        self.job_id = job_id

    def __str__(self) -> str:
        return self.args[0]


class AttemptConflict(RuntimeError):
    """A second live attempt of one job was asked for."""


class JobTables(StoreBase):
    """The jobs, attempts, checkpoints and schedule-change tables."""

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
        with self.writing(job_id) as s:
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

    # --- attempts and checkpoints -------------------------------------------------------------
    def start_attempt(self, job_id: int, launcher: str, **fields: Any) -> Attempt:
        """A new attempt of the job (numbered after its last), starting after its last checkpoint. Refused
        (AttemptConflict) while another attempt of the job is live: one job never has two drivers."""
        with self.session() as s, s.begin():
            s.execute(select(Job.id).where(Job.id == job_id).with_for_update())  # PostgreSQL: one start at a time
            return self._add_attempt(s, job_id, launcher, **fields)

    @staticmethod
    def _add_attempt(s: Session, job_id: int, launcher: str, **fields: Any) -> Attempt:
        """The job's next attempt, starting after its newest checkpoint, in `s`'s transaction; AttemptConflict while
        another attempt of the job is live."""
        live = s.scalars(select(Attempt).where(Attempt.job_id == job_id, Attempt.status != "ended")).first()
        if live is not None:
            raise AttemptConflict(
                f"job {job_id} already has a live attempt ({live.number}, {live.launcher} on "
                f"{live.driver_host or 'a Ray cluster'}): end it before starting another"
            )
        last = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())).first()
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

    def admit(
        self,
        job_id: int,
        launcher: str,
        host: str | None,
        budget: float,
        demand_of: Callable[[dict[str, Any]], float],
    ) -> Attempt | None:
        """Start a queued job if its CPUs fit: in one transaction that every server of the store serializes on, sum
        the demand of the live attempts on the same site (this host's, or the Ray cluster's for `ray_job`), and if
        the job fits `budget`, move it to `starting` and create its attempt there. None when it does not fit;
        InvalidTransition when the job is no longer queued. Two servers on one store share one budget per host."""
        with self.session() as s, s.begin():
            if s.get_bind().dialect.name == "postgresql":  # serializes admissions across servers until commit
                s.execute(text("select pg_advisory_xact_lock(7242)"))
            else:  # SQLite: any write statement, even one that matches no row, takes the write lock until commit
                s.execute(update(Job).where(Job.id == -1).values(updated_at=utcnow()))
            same_site = Attempt.launcher == launcher if host is None else Attempt.driver_host == host
            live = s.execute(
                select(Job.spec).join(Attempt, Attempt.job_id == Job.id).where(Attempt.status != "ended", same_site)
            )
            used = sum(demand_of(spec) for (spec,) in live)
            job = s.get(Job, job_id)
            if job is None or job.status != JobStatus.QUEUED.value:
                raise InvalidTransition(job_id, job.status if job else "queued", JobStatus.STARTING.value)
            if used + demand_of(job.spec) > budget + 1e-9:
                return None
            job.status, job.updated_at = JobStatus.STARTING.value, utcnow()
            s.add(Event(job_id=job_id, kind="status", message="queued → starting", data={"status": "starting"}))
            return self._add_attempt(s, job_id, launcher, driver_host=host)

    def update_attempt(self, attempt_id: int, **fields: Any) -> None:
        """Set columns of an attempt (a driver's view writes only while its attempt owns the job)."""
        with self.session() as s, s.begin():
            if self.fence is not None:
                self._check_lease(s, self.attempt(attempt_id).job_id, self.fence)
            s.execute(update(Attempt).where(Attempt.id == attempt_id).values(**fields))

    def end_attempt(self, attempt_id: int, reason: str) -> None:
        """Mark an attempt ended, with why."""
        self.update_attempt(attempt_id, status="ended", exit_reason=reason, ended_at=utcnow())

    def attempts(self, job_id: int | None = None, live_only: bool = False) -> list[Attempt]:
        """The attempts (of a job; only those not ended with `live_only`), oldest first."""
        query = select(Attempt)
        if job_id is not None:
            query = query.where(Attempt.job_id == job_id)
        if live_only:
            query = query.where(Attempt.status != "ended")
        with self.session() as s:
            return list(s.scalars(query.order_by(Attempt.id)))

    def attempt(self, attempt_id: int) -> Attempt:
        """One attempt; KeyError when there is none of that id."""
        with self.session() as s:
            attempt = s.get(Attempt, attempt_id)
            if attempt is None:
                raise KeyError(f"no attempt {attempt_id}")
            return attempt

    def add_checkpoint(self, job_id: int, step: int, weight_version: int, path: str) -> None:
        """Record a checkpoint written after `step`."""
        with self.writing(job_id) as s:
            s.add(Checkpoint(job_id=job_id, step=step, weight_version=weight_version, path=path))

    def prune_checkpoints(self, job_id: int, keep: int) -> list[str]:
        """Forget all but the newest `keep` checkpoints of a job; returns the paths of those forgotten."""
        with self.writing(job_id) as s:
            rows = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))
            old, kept = rows[:-keep], {row.path for row in rows[-keep:]}
            for row in old:
                s.delete(row)
            return sorted({row.path for row in old} - kept)  # a step saved twice (a redo) keeps its folder

    def checkpoints(self, job_id: int) -> list[Checkpoint]:
        """A job's checkpoints by step."""
        with self.session() as s:
            return list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))

    def last_checkpoint(self, job_id: int) -> Checkpoint | None:
        """The checkpoint of the job's latest step, if any."""
        checkpoints = self.checkpoints(job_id)
        return checkpoints[-1] if checkpoints else None

    # --- live schedule changes ----------------------------------------------------------------
    def request_schedule_change(self, job_id: int, patch: dict[str, Any]) -> int:
        """Queue a change of live schedule fields; the running job applies it at its next step boundary."""
        self.job(job_id)  # unknown ids fail here, not silently later
        with self.session() as s, s.begin():
            change = ScheduleChange(job_id=job_id, patch=patch)
            s.add(change)
            s.flush()
            return change.id

    def pending_schedule_changes(self, job_id: int) -> list[ScheduleChange]:
        """The changes the job has not applied or rejected yet, in the order they were queued."""
        with self.session() as s:
            query = select(ScheduleChange).where(ScheduleChange.job_id == job_id, ScheduleChange.status == "pending")
            return list(s.scalars(query.order_by(ScheduleChange.id)))

    def resolve_schedule_change(self, change_id: int, status: str, step: int | None, message: str) -> None:
        """Record what became of a queued change: its status, the step it took effect at and why."""
        with self.session() as s, s.begin():
            change = s.get(ScheduleChange, change_id)
            if self.fence is not None:
                self._check_lease(s, change.job_id, self.fence)
            change.status, change.applied_step, change.message = status, step, message

    def schedule_changes(self, job_id: int) -> list[ScheduleChange]:
        """Every change queued for the job, oldest first."""
        with self.session() as s:
            query = select(ScheduleChange).where(ScheduleChange.job_id == job_id)
            return list(s.scalars(query.order_by(ScheduleChange.id)))

    # --- reads --------------------------------------------------------------------------------
    def job(self, job_id: int) -> Job:
        """One job; JobNotFound when there is none of that id."""
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

    def count_by_status(self) -> dict[str, int]:
        """How many jobs are in each status."""
        with self.session() as s:
            return {status: n for status, n in s.execute(select(Job.status, func.count()).group_by(Job.status))}
