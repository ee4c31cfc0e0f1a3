"""A job's attempts under /api/v1/jobs/{job_id}: the attempts, the checkpoints they wrote, and their logs (the
driver's, each SGLang server's)."""

from __future__ import annotations

import re
from pathlib import Path as FilePath
from typing import Annotated

from fastapi import HTTPException, Query, Request
from fastapi.responses import PlainTextResponse

from miles_control.job.redact import mask_credentials
from miles_control.service.api.auth import ReadToken
from miles_control.service.api.deps import JobId, job_or_404, jobs_router, store_of
from miles_control.service.api.errors import JOB, documented
from miles_control.service.api.schemas import AttemptPublic, CheckpointPublic, LogSource
from miles_control.service.store import Job, Store

router = jobs_router()

AttemptNumber = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="Attempt number; the last one if omitted.")]
# sglang-<i>.log: server i's first process; sglang-<i>.restart-<n>.log: the process of its n-th restart (each
# restart logs to a file of its own, so the log of the crash it follows is kept). Served as engine-<i>[.restart-<n>].
ENGINE_LOG_FILE = re.compile(r"^sglang-(\d{1,4})(?:\.restart-([1-9]\d{0,3}))?\.log$")


@router.get("/{job_id}/attempts", response_model=list[AttemptPublic], responses=JOB)
def list_attempts(job_id: JobId, request: Request, _: ReadToken) -> list[AttemptPublic]:
    store = store_of(request)
    job_or_404(store, job_id)
    return [AttemptPublic.model_validate(a) for a in store.attempts(job_id)]


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointPublic], responses=JOB)
def list_checkpoints(job_id: JobId, request: Request, _: ReadToken) -> list[CheckpointPublic]:
    store = store_of(request)
    job_or_404(store, job_id)
    return [CheckpointPublic.model_validate(c) for c in store.checkpoints(job_id)]


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
    from miles_control.service.launch.drivers import engine_log_dir

    return engine_log_dir(FilePath(attempt.log_path)), ""


def _engine_log_files(folder: FilePath) -> dict[str, tuple[FilePath, str]]:
    """The SGLang server logs lying in `folder` itself (a link that leads elsewhere is not served), by source name,
    in server order and each server's in restart order, with a description."""
    if not folder.is_dir():
        return {}
    root = folder.resolve()
    found = []
    for path in folder.glob("sglang-*.log"):
        match = ENGINE_LOG_FILE.match(path.name)
        if match and path.is_file() and path.resolve().parent == root:
            index, restart = int(match.group(1)), int(match.group(2) or 0)
            found.append((index, restart, path))
    return {
        f"engine-{index}" + (f".restart-{restart}" if restart else ""): (
            path,
            f"SGLang server {index}" + (f", after restart {restart}" if restart else ""),
        )
        for index, restart, path in sorted(found)
    }


@router.get("/{job_id}/logs/sources", response_model=list[LogSource], responses=JOB, summary="The logs of an attempt")
def list_log_sources(job_id: JobId, request: Request, _: ReadToken, attempt: AttemptNumber = None) -> list[LogSource]:
    """What `get_logs` can show for an attempt: the driver's log, and each SGLang server's that this server can
    read (`engine-<i>`, and `engine-<i>.restart-<n>` for the process of its n-th restart; in server order)."""
    store = store_of(request)
    job = job_or_404(store, job_id)
    chosen = _attempt(store, job_id, attempt)
    size = FilePath(chosen.log_path).stat().st_size if chosen.log_path and FilePath(chosen.log_path).exists() else 0
    sources = [LogSource(name="driver", size_bytes=size, description="the driver: the job's own progress and errors")]
    folder = _engine_logs(store, job, chosen)[0]
    for name, (path, description) in _engine_log_files(folder).items() if folder is not None else ():
        sources.append(LogSource(name=name, size_bytes=path.stat().st_size, description=description))
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
            pattern=r"^(driver|engine-\d{1,4}(\.restart-\d{1,4})?)$",
            description="`driver` (the default), `engine-<i>`: SGLang server i's log, or `engine-<i>.restart-<n>`: "
            "its log after its n-th restart (list_log_sources).",
        ),
    ] = "driver",
) -> PlainTextResponse:
    store = store_of(request)
    job = job_or_404(store, job_id)
    chosen = _attempt(store, job_id, attempt)
    if source != "driver":
        folder, why = _engine_logs(store, job, chosen)
        if folder is None:
            raise HTTPException(404, why)
        path = _engine_log_files(folder).get(source, (FilePath(""), ""))[0]
        return _tail(path, tail_bytes, f"attempt {chosen.number} of job {job_id} has no {source} log")
    chosen = [chosen]
    if chosen[-1].launcher == "ray_job" and chosen[-1].submission_id:
        from miles_control.service.launch import RayJobDriver

        address = request.app.state.settings.ray_address
        if request.app.state.settings.launcher != "ray_job" or not address:
            raise HTTPException(404, f"attempt {chosen[-1].number} ran on a Ray cluster this server is not set up for")
        try:
            text = RayJobDriver(chosen[-1].id, address, chosen[-1].submission_id).logs()
        except Exception as exc:  # noqa: BLE001 - the cluster's answer, reported
            why = mask_credentials(f"the Ray cluster at {address} did not give the logs: {exc}")
            raise HTTPException(502, why) from None
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
