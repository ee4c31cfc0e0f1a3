"""Routes under /api/v1/jobs. Operation ids are the function names: stable, for typed clients."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path as FilePath
from typing import Annotated

import orjson
from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from miles_control.api.auth import AdminToken, ReadToken
from miles_control.api.errors import CHANGE, JOB, documented, unprocessable
from miles_control.api.policy import check_spec
from miles_control.api.requests import JobCreate, SchedulePatch
from miles_control.api.schemas import (
    AttemptPublic,
    CheckpointPublic,
    EventPublic,
    JobDetail,
    JobPage,
    JobPublic,
    LogSource,
    MetricPoint,
    RunSummaryPublic,
    SamplePublic,
    ScheduleChangePublic,
    SpanPublic,
    SpecCheck,
    StepPublic,
)
from miles_control.schedules.control import ScheduleChangeError, queue_schedule_change
from miles_control.store import FINAL, InvalidTransition, Job, JobNotFound, JobStatus, Store
from miles_control.store.tokens import check_token
from miles_rollout.headers import redact_headers

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"], responses=documented(401))


JobId = Annotated[int, Path(ge=1, le=2**31 - 1, description="The job's id.")]
StepBound = Annotated[int | None, Query(ge=0, le=2**31 - 1)]
Text = Annotated[str | None, Query(max_length=200, pattern=r"^[^\x00]*$")]
STATUSES = [s.value for s in JobStatus]


def _store(request: Request) -> Store:
    return request.app.state.store


def _job(store: Store, job_id: int) -> Job:
    try:
        return store.job(job_id)
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id}") from None


def _records(store: Store, job_id: int, model: type, rows: list) -> Response:
    """Rows of a job as JSON in the shape of `model` (serialized directly: these lists are the hot path of
    dashboards). An empty list is a 404 when the job does not exist."""
    if not rows:
        _job(store, job_id)
    fields = tuple(model.model_fields)
    rows_out = [{f: getattr(r, f) for f in fields} for r in rows]
    return Response(orjson.dumps(rows_out, option=orjson.OPT_NAIVE_UTC), media_type="application/json")  # times in UTC


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
    store = _store(request)
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
    store = _store(request)
    jobs, total = store.jobs(status=status, name=name, limit=limit, offset=offset)
    last = store.last_steps([j.id for j in jobs])
    return JobPage(items=[_public(j, last.get(j.id)) for j in jobs], total=total, limit=limit, offset=offset)


@router.get(
    "/{job_id}", response_model=JobDetail, summary="A job with its spec, attempts and checkpoints", responses=JOB
)
def get_job(job_id: JobId, request: Request, _: ReadToken) -> JobDetail:
    store = _store(request)
    return _detail(store, _job(store, job_id))


@router.post(
    "/{job_id}/cancel", response_model=JobDetail, summary="Cancel a queued, starting or running job", responses=CHANGE
)
def cancel_job(job_id: JobId, request: Request, _: AdminToken) -> JobDetail:
    store = _store(request)
    _job(store, job_id)
    try:
        store.request_cancel(job_id)
    except InvalidTransition as exc:
        raise HTTPException(409, str(exc)) from None
    return _detail(store, store.job(job_id))


@router.post(
    "/{job_id}/resume", response_model=JobDetail, summary="Queue a failed or cancelled job again", responses=CHANGE
)
def resume_job(job_id: JobId, request: Request, _: AdminToken) -> JobDetail:
    """The next attempt starts after the job's last checkpoint (from scratch when it has none)."""
    store = _store(request)
    if _job(store, job_id).source != "api":
        raise HTTPException(409, f"job {job_id} was run by `miles run`, not through the API; run its spec again there")
    try:
        store.resume(job_id)
    except InvalidTransition as exc:
        raise HTTPException(409, str(exc)) from None
    return _detail(store, store.job(job_id))


@router.patch(
    "/{job_id}/schedule",
    status_code=202,
    response_model=ScheduleChangePublic,
    summary="Change live schedule fields",
    responses=CHANGE,
)
def patch_schedule(job_id: JobId, body: SchedulePatch, request: Request, _: AdminToken) -> ScheduleChangePublic:
    """Applied at the job's next step boundary and recorded (see `list_schedule_changes` and the events)."""
    store = _store(request)
    _job(store, job_id)
    try:  # the same check `miles schedule set` runs
        change_id = queue_schedule_change(store, job_id, body.model_dump(exclude_none=True))
    except ScheduleChangeError as exc:
        if exc.conflict:
            raise HTTPException(409, str(exc)) from None
        raise unprocessable(["body"], str(exc)) from None
    return ScheduleChangePublic.model_validate(next(c for c in store.schedule_changes(job_id) if c.id == change_id))


@router.get("/{job_id}/schedule-changes", response_model=list[ScheduleChangePublic], responses=JOB)
def list_schedule_changes(job_id: JobId, request: Request, _: ReadToken) -> list[ScheduleChangePublic]:
    store = _store(request)
    _job(store, job_id)
    return [ScheduleChangePublic.model_validate(c) for c in store.schedule_changes(job_id)]


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
    store = _store(request)
    return _records(store, job_id, MetricPoint, store.metrics(job_id, name, step_min, step_max))


@router.get("/{job_id}/metric-names", response_model=list[str], responses=JOB)
def list_metric_names(job_id: JobId, request: Request, _: ReadToken) -> list[str]:
    store = _store(request)
    _job(store, job_id)
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
    store = _store(request)
    return _records(store, job_id, SpanPublic, store.spans(job_id, stage, step_min, step_max))


@router.get(
    "/{job_id}/summary",
    response_model=RunSummaryPublic,
    summary="Time per stage, throughput, busy time, the ideal-overlap bound, weight-update latency",
    responses=JOB,
)
def get_summary(job_id: JobId, request: Request, _: ReadToken) -> dict:
    from miles_control.summary import summarize

    store = _store(request)
    _job(store, job_id)
    return summarize(store, job_id).to_dict()


@router.get("/{job_id}/steps", response_model=list[StepPublic], responses=JOB)
def get_steps(job_id: JobId, request: Request, _: ReadToken) -> Response:
    store = _store(request)
    return _records(store, job_id, StepPublic, store.steps(job_id))


@router.get("/{job_id}/events", response_model=list[EventPublic], responses=JOB)
def get_events(
    job_id: JobId,
    request: Request,
    _: ReadToken,
    after_id: Annotated[int, Query(ge=0, le=2**31 - 1, description="Only events with a larger id.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> Response:
    store = _store(request)
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
    store = _store(request)
    await run_in_threadpool(_job, store, job_id)
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
    store = _store(request)
    return _records(store, job_id, SamplePublic, store.samples(job_id, step, limit))


@router.get("/{job_id}/attempts", response_model=list[AttemptPublic], responses=JOB)
def list_attempts(job_id: JobId, request: Request, _: ReadToken) -> list[AttemptPublic]:
    store = _store(request)
    _job(store, job_id)
    return [AttemptPublic.model_validate(a) for a in store.attempts(job_id)]


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointPublic], responses=JOB)
def list_checkpoints(job_id: JobId, request: Request, _: ReadToken) -> list[CheckpointPublic]:
    store = _store(request)
    _job(store, job_id)
    return [CheckpointPublic.model_validate(c) for c in store.checkpoints(job_id)]


AttemptNumber = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="Attempt number; the last one if omitted.")]
ENGINE_LOG = re.compile(r"^engine-(\d{1,4})$")


def _attempt(store: Store, job_id: int, attempt: int | None):
    chosen = [a for a in store.attempts(job_id) if attempt is None or a.number == attempt]
    if not chosen:
        raise HTTPException(
            404, f"job {job_id} has no attempt {attempt}" if attempt else f"job {job_id} has no attempt yet"
        )
    return chosen[-1]


def _engine_logs(store: Store, job: Job, attempt) -> tuple[FilePath | None, str]:
    """The folder of an attempt's SGLang server logs on this server, or None and why not. The launcher gives each
    attempt its own folder beside the driver's log. A spec's rollout.engine.log_dir is used for a job created over the
    API (the API's policy confined it to the runs folder; a job stored by `miles run --store` was not checked) and
    only for its latest attempt (every attempt writes the same files)."""
    engine = (job.spec.get("rollout") or {}).get("engine") or {}
    if engine.get("type") != "sglang":
        return None, f"job {job.id} runs no SGLang servers (engine {engine.get('type')})"
    if engine.get("log_dir"):
        if job.source != "api":
            return None, f"job {job.id} was not created over the API: its rollout.engine.log_dir is not served"
        if attempt.number != store.attempts(job.id)[-1].number:
            return (
                None,
                f"attempt {attempt.number}'s engine logs in rollout.engine.log_dir were replaced by a later one",
            )
        return FilePath(engine["log_dir"]), ""
    if attempt.launcher == "ray_job" or not attempt.log_path:
        return None, f"attempt {attempt.number} of job {job.id} ran elsewhere: its engine logs stay on its nodes"
    from miles_control.launch.drivers import engine_log_dir

    return engine_log_dir(FilePath(attempt.log_path)), ""


def _engine_log_files(folder: FilePath) -> dict[int, FilePath]:
    """`sglang-<i>.log` files lying in `folder` itself (a link that leads elsewhere is not served)."""
    if not folder.is_dir():
        return {}
    root = folder.resolve()
    found = {}
    for path in folder.glob("sglang-*.log"):
        match = re.match(r"sglang-(\d{1,4})\.log$", path.name)
        if match and path.is_file() and path.resolve().parent == root:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


@router.get("/{job_id}/logs/sources", response_model=list[LogSource], responses=JOB, summary="The logs of an attempt")
def list_log_sources(job_id: JobId, request: Request, _: ReadToken, attempt: AttemptNumber = None) -> list[LogSource]:
    """What `get_logs` can show for an attempt: the driver's log, and each SGLang server's that this server can
    read (`engine-<i>`, in server order)."""
    store = _store(request)
    job = _job(store, job_id)
    chosen = _attempt(store, job_id, attempt)
    size = FilePath(chosen.log_path).stat().st_size if chosen.log_path and FilePath(chosen.log_path).exists() else 0
    sources = [LogSource(name="driver", size_bytes=size, description="the driver: the job's own progress and errors")]
    folder, _ = _engine_logs(store, job, chosen)
    for index, path in _engine_log_files(folder).items() if folder is not None else ():
        sources.append(
            LogSource(name=f"engine-{index}", size_bytes=path.stat().st_size, description=f"SGLang server {index}")
        )
    return sources


@router.get(
    "/{job_id}/logs",
    responses=JOB | documented(502) | {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    summary="The tail of an attempt's driver or engine log",
)
def get_logs(
    job_id: JobId,
    request: Request,
    _: ReadToken,
    attempt: AttemptNumber = None,
    tail_bytes: Annotated[int, Query(ge=1, le=16 << 20)] = 64 << 10,
    source: Annotated[
        str,
        Query(
            pattern=r"^(driver|engine-\d{1,4})$",
            description="`driver` (the default), or `engine-<i>`: SGLang server i's log (list_log_sources).",
        ),
    ] = "driver",
) -> PlainTextResponse:
    store = _store(request)
    job = _job(store, job_id)
    chosen = _attempt(store, job_id, attempt)
    if source != "driver":
        folder, why = _engine_logs(store, job, chosen)
        if folder is None:
            raise HTTPException(404, why)
        match = ENGINE_LOG.match(source)
        assert match is not None  # the query's pattern
        path = _engine_log_files(folder).get(int(match.group(1)))
        return _tail(path or FilePath(""), tail_bytes, f"attempt {chosen.number} of job {job_id} has no {source} log")
    chosen = [chosen]
    if chosen[-1].launcher == "ray_job" and chosen[-1].submission_id:
        from miles_control.launch import RayJobDriver

        address = request.app.state.settings.ray_address
        if request.app.state.settings.launcher != "ray_job" or not address:
            raise HTTPException(404, f"attempt {chosen[-1].number} ran on a Ray cluster this server is not set up for")
        try:
            text = RayJobDriver(chosen[-1].id, address, chosen[-1].submission_id).logs()
        except Exception as exc:  # noqa: BLE001 - the cluster's answer, reported
            raise HTTPException(502, f"the Ray cluster at {address} did not give the logs: {exc}") from None
        return PlainTextResponse(text[-tail_bytes:])
    path = chosen[-1].log_path
    return _tail(
        FilePath(path or ""), tail_bytes, f"attempt {chosen[-1].number} of job {job_id} has no log on this server"
    )


def _tail(path: FilePath, tail_bytes: int, missing: str) -> PlainTextResponse:
    if not path.name or not path.is_file():
        raise HTTPException(404, missing)
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - tail_bytes))
        return PlainTextResponse(f.read().decode("utf-8", errors="replace"))
