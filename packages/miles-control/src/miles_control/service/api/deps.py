"""What the routes under /api/v1/jobs share: their path and query types, the store, a job or a 404."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request

from miles_control.service.api.errors import documented
from miles_control.service.store import Job, JobNotFound, Store

JobId = Annotated[int, Path(ge=1, le=2**31 - 1, description="The job's id.")]
StepBound = Annotated[int | None, Query(ge=0, le=2**31 - 1)]
Text = Annotated[str | None, Query(max_length=200, pattern=r"^[^\x00]*$")]


def jobs_router() -> APIRouter:
    """A router under /api/v1/jobs: every module of job routes has one, `routes.router` joins them."""
    return APIRouter(prefix="/api/v1/jobs", tags=["jobs"], responses=documented(401))


def store_of(request: Request) -> Store:
    """The job store of the app serving `request`."""
    return request.app.state.store


def job_or_404(store: Store, job_id: int) -> Job:
    """The job, or a 404 naming it."""
    try:
        return store.job(job_id)
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id}") from None
