"""Routes under /api/v1/jobs. Operation ids are the function names: stable, for typed clients.

One router joins them, in the order the OpenAPI document lists them: the jobs themselves (`jobs`), what their
runs record (`job_records`), their attempts, checkpoints and logs (`attempts`)."""

from __future__ import annotations

from fastapi import APIRouter

from miles_control.service.api import attempts, job_records, jobs

router = APIRouter()
router.include_router(jobs.router)
router.include_router(job_records.router)
router.include_router(attempts.router)
