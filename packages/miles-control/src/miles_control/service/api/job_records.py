"""What a job's runs record, under /api/v1/jobs/{job_id}: metrics, timing spans and their summary, steps, events
(also as a server-sent stream) and samples."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated

import orjson
from fastapi import Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from miles_control.service.api.auth import ReadToken
from miles_control.service.api.deps import JobId, StepBound, Text, job_or_404, jobs_router, store_of
from miles_control.service.api.errors import JOB, unprocessable
from miles_control.service.api.schemas import (
    EventPublic,
    MetricPoint,
    RunSummaryPublic,
    SamplePublic,
    SpanPublic,
    StepPublic,
)
from miles_control.service.store import FINAL, JobStatus, Store
from miles_control.service.store.tokens import check_token

router = jobs_router()


def _records(store: Store, job_id: int, model: type[BaseModel], rows: list) -> Response:
    """Rows of a job as JSON in the shape of `model` (serialized directly: these lists are the hot path of
    dashboards). An empty list is a 404 when the job does not exist."""
    if not rows:
        job_or_404(store, job_id)
    fields = tuple(model.model_fields)
    rows_out = [{f: getattr(r, f) for f in fields} for r in rows]
    return Response(orjson.dumps(rows_out, option=orjson.OPT_NAIVE_UTC), media_type="application/json")  # times in UTC


@router.get(
    "/{job_id}/metrics", response_model=list[MetricPoint], summary="Metric points by name and step range", responses=JOB
)
def get_metrics(
    job_id: JobId,
    request: Request,
    _: ReadToken,
    name: Annotated[list[str] | None, Query(description="Metric names, e.g. eval/accuracy; all when omitted.")] = None,
    step_min: StepBound = None,
    step_max: StepBound = None,
) -> Response:
    if any(len(n) > 200 or "\x00" in n for n in name or []):
        raise unprocessable(["query", "name"], "at most 200 characters, no NUL")
    store = store_of(request)
    return _records(store, job_id, MetricPoint, store.metrics(job_id, name, step_min, step_max))


@router.get("/{job_id}/metric-names", response_model=list[str], responses=JOB)
def list_metric_names(job_id: JobId, request: Request, _: ReadToken) -> list[str]:
    store = store_of(request)
    job_or_404(store, job_id)
    return store.metric_names(job_id)


@router.get("/{job_id}/spans", response_model=list[SpanPublic], summary="Per-stage timing spans", responses=JOB)
def get_spans(
    job_id: JobId,
    request: Request,
    _: ReadToken,
    stage: Text = None,
    step_min: StepBound = None,
    step_max: StepBound = None,
) -> Response:
    store = store_of(request)
    return _records(store, job_id, SpanPublic, store.spans(job_id, stage, step_min, step_max))


@router.get(
    "/{job_id}/summary",
    response_model=RunSummaryPublic,
    summary="Time per stage, throughput, busy time, the ideal-overlap bound, weight-update latency",
    responses=JOB,
)
def get_summary(job_id: JobId, request: Request, _: ReadToken) -> dict:
    from miles_control.service.summary import summarize

    store = store_of(request)
    job_or_404(store, job_id)
    return summarize(store, job_id).to_dict()


@router.get("/{job_id}/steps", response_model=list[StepPublic], responses=JOB)
def get_steps(job_id: JobId, request: Request, _: ReadToken) -> Response:
    store = store_of(request)
    return _records(store, job_id, StepPublic, store.steps(job_id))


@router.get("/{job_id}/events", response_model=list[EventPublic], responses=JOB)
def get_events(
    job_id: JobId,
    request: Request,
    _: ReadToken,
    after_id: Annotated[int, Query(ge=0, le=2**31 - 1, description="Only events with a larger id.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> Response:
    store = store_of(request)
    return _records(store, job_id, EventPublic, store.events(job_id, after_id, limit))


@router.get(
    "/{job_id}/events/stream",
    summary="Events as server-sent events; ends once the job is final",
    response_class=StreamingResponse,
    responses=JOB | {200: {"content": {"text/event-stream": {}}}},
)
async def stream_events(
    job_id: JobId,
    request: Request,
    _: ReadToken,
    after_id: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> StreamingResponse:
    """Each event: `id:` (send it back as `Last-Event-ID` to continue), `event:` (its kind), `data:` (JSON).

    The stream ends with `event: end` once the job is final, `event: shutdown` when the server stops (reconnect
    with `Last-Event-ID`), or `event: unauthorized` when its token was revoked (checked every
    `token_cache_s`, at least every second)."""
    store = store_of(request)
    await run_in_threadpool(job_or_404, store, job_id)
    last_header = request.headers.get("last-event-id", "")
    last_id = int(last_header[:10]) if last_header[:10].isdigit() and len(last_header) <= 10 else after_id
    last_id = min(last_id, 2**31 - 1)
    state = request.app.state
    poll_s = state.settings.poll_interval_s / 2
    recheck_s = max(state.settings.token_cache_s, 1.0)
    secret = request.headers.get("authorization", "").partition(" ")[2]

    async def events():
        nonlocal last_id
        idle = 0.0
        checked = time.monotonic()
        while not await request.is_disconnected():
            if state.stopping.is_set():
                yield f"event: shutdown\ndata: {json.dumps({'detail': 'the server is stopping; reconnect later'})}\n\n"
                return
            if time.monotonic() - checked >= recheck_s:
                checked = time.monotonic()
                if await run_in_threadpool(check_token, store, secret) is None:
                    yield f"event: unauthorized\ndata: {json.dumps({'detail': 'invalid or revoked token'})}\n\n"
                    return
            batch = await run_in_threadpool(store.events, job_id, last_id, 500)
            for e in batch:
                data = EventPublic.model_validate(e).model_dump(mode="json")
                yield f"id: {e.id}\nevent: {e.kind}\ndata: {json.dumps(data)}\n\n"
                last_id = e.id
            if not batch:
                job = await run_in_threadpool(store.job, job_id)
                if JobStatus(job.status) in FINAL:
                    yield f"event: end\ndata: {json.dumps({'status': job.status})}\n\n"
                    return
                idle += poll_s
                if idle >= 15:
                    idle = 0.0
                    yield ": keep-alive\n\n"
                await asyncio.sleep(poll_s)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get(
    "/{job_id}/samples", response_model=list[SamplePublic], summary="A few generations per step, as text", responses=JOB
)
def get_samples(
    job_id: JobId,
    request: Request,
    _: ReadToken,
    step: StepBound = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Response:
    store = store_of(request)
    return _records(store, job_id, SamplePublic, store.samples(job_id, step, limit))
