"""The jobs themselves under /api/v1/jobs: create, validate, list, show, cancel, resume, change the schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import HTTPException, Query, Request

from miles_control.service.api.auth import AdminToken, ReadToken
from miles_control.service.api.deps import JobId, Text, job_or_404, jobs_router, store_of
from miles_control.service.api.errors import CHANGE, JOB, documented, unprocessable
from miles_control.service.api.policy import check_spec
from miles_control.service.api.requests import JobCreate, SchedulePatch
from miles_control.service.api.schemas import (
    AttemptPublic,
    CheckpointPublic,
    JobDetail,
    JobPage,
    JobPublic,
    ScheduleChangePublic,
    SpecCheck,
)
from miles_control.service.schedule_changes import ScheduleChangeError, queue_schedule_change
from miles_control.service.store import InvalidTransition, Job, JobStatus, Store
from miles_rollout.headers import redact_headers

router = jobs_router()

STATUSES = [s.value for s in JobStatus]


def _public(job: Job, last_step: int | None) -> dict:
    spec = job.spec or {}
    schedule = spec.get("schedule", {})
    return dict(
        JobPublic.model_validate(
            {
                **{k: getattr(job, k) for k in JobPublic.model_fields if hasattr(job, k)},
                "schedule": schedule.get("type", "sync"),
                "num_steps": schedule.get("num_steps", 0),
                "last_step": last_step,
                "resumable": job.status in (JobStatus.FAILED.value, JobStatus.CANCELLED.value),
            }
        )
    )


def _detail(store: Store, job: Job) -> JobDetail:
    return JobDetail(
        **_public(job, store.last_step(job.id)),
        spec=redact_headers(job.spec or {}),  # a reward service's key is not shown to every reader
        attempts=[AttemptPublic.model_validate(a) for a in store.attempts(job.id)],
        checkpoints=[CheckpointPublic.model_validate(c) for c in store.checkpoints(job.id)],
    )


def _transition(store: Store, job_id: int, change: Callable[[int], object]) -> JobDetail:
    """Apply a status change (`store.request_cancel`, `store.resume`); one the job's status forbids is a 409."""
    try:
        change(job_id)
    except InvalidTransition as exc:
        raise HTTPException(409, str(exc)) from None
    return _detail(store, store.job(job_id))


@router.post(
    "",
    status_code=201,
    response_model=JobDetail,
    summary="Create a job (queued; launched when CPUs free)",
    responses=documented(400, 403, 413),
)
def create_job(body: JobCreate, request: Request, _: AdminToken) -> JobDetail:
    spec, problems = check_spec(body.spec, request.app.state.settings)
    if problems:
        raise HTTPException(422, problems)
    store = store_of(request)
    job_id = store.create_job(spec.name, spec.model_dump(mode="json", exclude={"store"}), source="api")
    return _detail(store, store.job(job_id))


@router.post(
    "/validate",
    response_model=SpecCheck,
    summary="Check a job spec as create_job would, without creating a job",
    responses=documented(400, 403, 413),
)
def validate_job(body: JobCreate, request: Request, _: AdminToken) -> SpecCheck:
    """The same checks as `create_job` (the spec's own, then this server's policy): a 422 lists every problem by
    field; a 200 gives the spec as the job would run it (defaults filled in, paths made absolute)."""
    spec, problems = check_spec(body.spec, request.app.state.settings)
    if problems:
        raise HTTPException(422, problems)
    return SpecCheck(spec=spec.model_dump(mode="json", exclude={"store"}))


@router.get("", response_model=JobPage, summary="List jobs, newest first")
def list_jobs(
    request: Request,
    _: ReadToken,
    status: Annotated[list[str] | None, Query(description=f"One or more of {', '.join(STATUSES)}.")] = None,
    name: Annotated[Text, Query(description="Jobs whose name contains this.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> JobPage:
    for value in status or []:
        if value not in STATUSES:
            raise unprocessable(["query", "status"], f"status {value!r} is not one of {', '.join(STATUSES)}")
    store = store_of(request)
    jobs, total = store.jobs(status=status, name=name, limit=limit, offset=offset)
    last = store.last_steps([j.id for j in jobs])
    return JobPage(items=[_public(j, last.get(j.id)) for j in jobs], total=total, limit=limit, offset=offset)


@router.get(
    "/{job_id}", response_model=JobDetail, summary="A job with its spec, attempts and checkpoints", responses=JOB
)
def get_job(job_id: JobId, request: Request, _: ReadToken) -> JobDetail:
    store = store_of(request)
    return _detail(store, job_or_404(store, job_id))


@router.post(
    "/{job_id}/cancel", response_model=JobDetail, summary="Cancel a queued, starting or running job", responses=CHANGE
)
def cancel_job(job_id: JobId, request: Request, _: AdminToken) -> JobDetail:
    store = store_of(request)
    job_or_404(store, job_id)
    return _transition(store, job_id, store.request_cancel)


@router.post(
    "/{job_id}/resume", response_model=JobDetail, summary="Queue a failed or cancelled job again", responses=CHANGE
)
def resume_job(job_id: JobId, request: Request, _: AdminToken) -> JobDetail:
    """The next attempt starts after the job's last checkpoint (from scratch when it has none)."""
    store = store_of(request)
    if job_or_404(store, job_id).source != "api":
        raise HTTPException(409, f"job {job_id} was run by `miles run`, not through the API; run its spec again there")
    return _transition(store, job_id, store.resume)


@router.patch(
    "/{job_id}/schedule",
    status_code=202,
    response_model=ScheduleChangePublic,
    summary="Change live schedule fields",
    responses=CHANGE,
)
def patch_schedule(job_id: JobId, body: SchedulePatch, request: Request, _: AdminToken) -> ScheduleChangePublic:
    """Applied at the job's next step boundary and recorded (see `list_schedule_changes` and the events)."""
    store = store_of(request)
    job_or_404(store, job_id)
    try:  # the same check `miles schedule set` runs
        change_id = queue_schedule_change(store, job_id, body.model_dump(exclude_none=True))
    except ScheduleChangeError as exc:
        if exc.conflict:
            raise HTTPException(409, str(exc)) from None
        raise unprocessable(["body"], str(exc)) from None
    return ScheduleChangePublic.model_validate(next(c for c in store.schedule_changes(job_id) if c.id == change_id))


@router.get("/{job_id}/schedule-changes", response_model=list[ScheduleChangePublic], responses=JOB)
def list_schedule_changes(job_id: JobId, request: Request, _: ReadToken) -> list[ScheduleChangePublic]:
    store = store_of(request)
    job_or_404(store, job_id)
    return [ScheduleChangePublic.model_validate(c) for c in store.schedule_changes(job_id)]
