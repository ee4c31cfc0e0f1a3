"""The typed client of the Miles REST API (`/api/v1`), used by the `miles jobs` CLI and `examples/api_client.py`.

Every call returns the API's own response models (`miles_control.service.api.schemas`), so a field the server renames
breaks type checks and tests here rather than a dashboard at run time. `OPERATIONS` maps each operation of
the OpenAPI document to the method that calls it; `tests/test_client.py` checks both against the document
the server publishes (every operation has a method, every method's verb and path are the document's).

Imports httpx and pydantic only (and the API's schema models, which import no torch).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter

from miles_control.service.api.schemas import (
    AttemptPublic,
    CheckpointPublic,
    EventPublic,
    Health,
    JobDetail,
    JobPage,
    LogSource,
    MetricPoint,
    PresetPublic,
    ReportDetail,
    ReportPublic,
    RunSummaryPublic,
    SamplePublic,
    ScheduleChangePublic,
    SpanPublic,
    SpecCheck,
    StepPublic,
)

T = TypeVar("T")

# operationId → (HTTP method, path, client method). Checked against the published document by tests.
OPERATIONS: dict[str, tuple[str, str, str]] = {
    "health": ("GET", "/api/v1/health", "health"),
    "list_jobs": ("GET", "/api/v1/jobs", "jobs"),
    "create_job": ("POST", "/api/v1/jobs", "create_job"),
    "validate_job": ("POST", "/api/v1/jobs/validate", "validate_job"),
    "list_reports": ("GET", "/api/v1/reports", "reports"),
    "get_report": ("GET", "/api/v1/reports/{report_id}", "report"),
    "get_report_file": ("GET", "/api/v1/reports/{report_id}/files/{name}", "report_file"),
    "get_job": ("GET", "/api/v1/jobs/{job_id}", "job"),
    "cancel_job": ("POST", "/api/v1/jobs/{job_id}/cancel", "cancel"),
    "resume_job": ("POST", "/api/v1/jobs/{job_id}/resume", "resume"),
    "patch_schedule": ("PATCH", "/api/v1/jobs/{job_id}/schedule", "patch_schedule"),
    "list_schedule_changes": ("GET", "/api/v1/jobs/{job_id}/schedule-changes", "schedule_changes"),
    "get_metrics": ("GET", "/api/v1/jobs/{job_id}/metrics", "metrics"),
    "list_metric_names": ("GET", "/api/v1/jobs/{job_id}/metric-names", "metric_names"),
    "get_spans": ("GET", "/api/v1/jobs/{job_id}/spans", "spans"),
    "get_summary": ("GET", "/api/v1/jobs/{job_id}/summary", "summary"),
    "get_steps": ("GET", "/api/v1/jobs/{job_id}/steps", "steps"),
    "get_events": ("GET", "/api/v1/jobs/{job_id}/events", "events"),
    "stream_events": ("GET", "/api/v1/jobs/{job_id}/events/stream", "stream_events"),
    "get_samples": ("GET", "/api/v1/jobs/{job_id}/samples", "samples"),
    "list_attempts": ("GET", "/api/v1/jobs/{job_id}/attempts", "attempts"),
    "list_checkpoints": ("GET", "/api/v1/jobs/{job_id}/checkpoints", "checkpoints"),
    "get_logs": ("GET", "/api/v1/jobs/{job_id}/logs", "logs"),
    "list_log_sources": ("GET", "/api/v1/jobs/{job_id}/logs/sources", "log_sources"),
    "list_presets": ("GET", "/api/v1/presets", "presets"),
    "prometheus_metrics": ("GET", "/metrics", "prometheus"),
}


class ApiError(Exception):
    """An answer of 4xx/5xx, or no answer. `fields` maps a spec field path to its problem (a 422 on a spec)."""

    def __init__(self, status: int | None, detail: Any) -> None:
        self.status, self.detail = status, detail
        self.fields: dict[str, str] = {}
        if isinstance(detail, list):
            for item in detail:
                loc = [str(p) for p in item.get("loc", [])]
                if loc[:2] == ["body", "spec"]:
                    loc = loc[2:]
                elif loc[:1] == ["body"]:
                    loc = loc[1:]
                self.fields[".".join(loc) or "(spec)"] = item.get("msg", "")
        super().__init__(self.message)

    @property
    def message(self) -> str:
        if self.fields:
            return "; ".join(f"{k}: {v}" for k, v in self.fields.items())
        prefix = f"{self.status}: " if self.status else ""
        return f"{prefix}{self.detail}"


def _params(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None and v != []}


class MilesClient:
    """Typed calls of `/api/v1` with a bearer token; every method raises `ApiError` with the server's message."""

    def __init__(self, url: str, token: str = "", timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> MilesClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing -------------------------------------------------------------------------------
    def _request(
        self, operation: str, job_id: int | None = None, *, where: dict[str, Any] | None = None, **kwargs: Any
    ) -> httpx.Response:
        """One call of an operation; `job_id` and `where` fill its path's parameters."""
        method, path, _ = OPERATIONS[operation]
        try:
            response = self.http.request(method, path.format(job_id=job_id, **(where or {})), **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(None, f"cannot reach the Miles API at {self.url} ({type(exc).__name__})") from None
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ApiError(response.status_code, detail)
        return response

    def _call(self, shape: type[T] | Any, operation: str, job_id: int | None = None, **kwargs: Any) -> T:
        response = self._request(operation, job_id, **kwargs)
        return TypeAdapter(shape).validate_json(response.content)

    # ---- reads ----------------------------------------------------------------------------------
    def health(self) -> Health:
        return self._call(Health, "health")

    def jobs(
        self, status: list[str] | None = None, name: str | None = None, limit: int = 100, offset: int = 0
    ) -> JobPage:
        return self._call(JobPage, "list_jobs", params=_params(status=status, name=name, limit=limit, offset=offset))

    def job(self, job_id: int) -> JobDetail:
        return self._call(JobDetail, "get_job", job_id)

    def metrics(
        self, job_id: int, names: list[str] | None = None, step_min: int | None = None, step_max: int | None = None
    ) -> list[MetricPoint]:
        params = _params(name=names, step_min=step_min, step_max=step_max)
        return self._call(list[MetricPoint], "get_metrics", job_id, params=params)

    def metric_names(self, job_id: int) -> list[str]:
        return self._call(list[str], "list_metric_names", job_id)

    def spans(
        self, job_id: int, stage: str | None = None, step_min: int | None = None, step_max: int | None = None
    ) -> list[SpanPublic]:
        params = _params(stage=stage, step_min=step_min, step_max=step_max)
        return self._call(list[SpanPublic], "get_spans", job_id, params=params)

    def summary(self, job_id: int) -> RunSummaryPublic:
        return self._call(RunSummaryPublic, "get_summary", job_id)

    def steps(self, job_id: int) -> list[StepPublic]:
        return self._call(list[StepPublic], "get_steps", job_id)

    def events(self, job_id: int, after_id: int = 0, limit: int = 200) -> list[EventPublic]:
        return self._call(list[EventPublic], "get_events", job_id, params={"after_id": after_id, "limit": limit})

    def stream_events(self, job_id: int, after_id: int = 0) -> Iterator[tuple[str, dict[str, Any], int | None]]:
        """(kind, data, event id) as the server sends them; ends after `end` (the job is final)."""
        method, path, _ = OPERATIONS["stream_events"]
        url = path.format(job_id=job_id)
        headers = {"Last-Event-ID": str(after_id)} if after_id else {}
        try:
            with self.http.stream(method, url, headers=headers, timeout=None) as response:
                if response.status_code >= 400:
                    response.read()
                    try:
                        detail = response.json().get("detail", response.text)
                    except ValueError:
                        detail = response.text
                    raise ApiError(response.status_code, detail)
                kind, event_id = "", None
                for line in response.iter_lines():
                    if line.startswith("id: "):
                        event_id = int(line.removeprefix("id: "))
                    elif line.startswith("event: "):
                        kind = line.removeprefix("event: ")
                    elif line.startswith("data: "):
                        yield kind, json.loads(line.removeprefix("data: ")), event_id
        except httpx.HTTPError as exc:
            raise ApiError(None, f"the event stream of job {job_id} broke off ({type(exc).__name__})") from None

    def samples(self, job_id: int, step: int | None = None, limit: int = 200) -> list[SamplePublic]:
        return self._call(list[SamplePublic], "get_samples", job_id, params=_params(step=step, limit=limit))

    def attempts(self, job_id: int) -> list[AttemptPublic]:
        return self._call(list[AttemptPublic], "list_attempts", job_id)

    def checkpoints(self, job_id: int) -> list[CheckpointPublic]:
        return self._call(list[CheckpointPublic], "list_checkpoints", job_id)

    def schedule_changes(self, job_id: int) -> list[ScheduleChangePublic]:
        return self._call(list[ScheduleChangePublic], "list_schedule_changes", job_id)

    def logs(self, job_id: int, attempt: int | None = None, tail_bytes: int = 64 << 10, source: str = "driver") -> str:
        """The tail of an attempt's log: the driver's, or `engine-<i>` (SGLang server i; see `log_sources`)."""
        params = _params(attempt=attempt, tail_bytes=tail_bytes, source=source)
        return self._request("get_logs", job_id, params=params).text

    def log_sources(self, job_id: int, attempt: int | None = None) -> list[LogSource]:
        """The logs `logs` can show for an attempt (the last by default): the driver's and each SGLang server's."""
        return self._call(list[LogSource], "list_log_sources", job_id, params=_params(attempt=attempt))

    def presets(self) -> list[PresetPublic]:
        """Job specs the server offers as starting points (its `presets_dir`)."""
        return self._call(list[PresetPublic], "list_presets")

    def reports(self, kind: str | None = None) -> list[ReportPublic]:
        """Bench reports stored with their runs, newest first."""
        return self._call(list[ReportPublic], "list_reports", params=_params(kind=kind))

    def report(self, report_id: int) -> ReportDetail:
        return self._call(ReportDetail, "get_report", where={"report_id": report_id})

    def report_file(self, report_id: int, name: str) -> bytes:
        """A file of a report (a PNG plot its markdown links)."""
        return self._request("get_report_file", where={"report_id": report_id, "name": name}).content

    def prometheus(self) -> str:
        return self._request("prometheus_metrics").text

    def choices(self, schema: str, field: str) -> list[str]:
        """The values the API accepts for `field` of a request `schema`, from its OpenAPI document."""
        try:
            document = self.http.get("/openapi.json").raise_for_status().json()
        except httpx.HTTPError as exc:
            raise ApiError(None, f"cannot read the API's schema at {self.url} ({type(exc).__name__})") from None
        spec = document["components"]["schemas"][schema]["properties"][field]
        for option in [spec, *spec.get("anyOf", [])]:
            if "enum" in option:
                return list(option["enum"])
        raise ApiError(None, f"the API's {schema}.{field} has no enumerated values")

    # ---- changes --------------------------------------------------------------------------------
    def create_job(self, spec: dict[str, Any] | BaseModel) -> JobDetail:
        body = spec.model_dump(mode="json") if isinstance(spec, BaseModel) else spec
        return self._call(JobDetail, "create_job", json={"spec": body})

    def validate_job(self, spec: dict[str, Any] | BaseModel) -> dict[str, Any]:
        """The spec as a job would run it, or an ApiError (422) whose `fields` name every problem; creates nothing."""
        body = spec.model_dump(mode="json") if isinstance(spec, BaseModel) else spec
        return self._call(SpecCheck, "validate_job", json={"spec": body}).spec

    def cancel(self, job_id: int) -> JobDetail:
        return self._call(JobDetail, "cancel_job", job_id)

    def resume(self, job_id: int) -> JobDetail:
        return self._call(JobDetail, "resume_job", job_id)

    def patch_schedule(self, job_id: int, patch: dict[str, Any]) -> ScheduleChangePublic:
        return self._call(ScheduleChangePublic, "patch_schedule", job_id, json=patch)
