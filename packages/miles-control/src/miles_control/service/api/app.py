"""The API server: FastAPI under /api/v1, Prometheus at /metrics, the launcher in the same process.

`create_app(settings)` builds it; `miles serve` runs it with uvicorn."""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import text

from miles_control.service.api.auth import ReadToken
from miles_control.service.api.errors import documented
from miles_control.service.api.reports import router as reports_router
from miles_control.service.api.routes import router
from miles_control.service.api.schemas import Health, PresetPublic
from miles_control.service.launch import Launcher
from miles_control.service.settings import ServerSettings
from miles_control.service.store import JobStatus, Store
from miles_control.spec.load import explain, input_loc, kind_errors

log = logging.getLogger(__name__)

try:
    VERSION = version("miles-control")
except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
    VERSION = "0.0.0"


MAX_JSON_DEPTH = 32  # a job spec nests 4 levels; deeper input is refused before any parser recurses into it


def json_body_problem(body: bytes) -> str | None:
    """Why a request body is refused before parsing (400): not UTF-8, or nested too deep. Every body is JSON here
    (no route takes another kind), and FastAPI parses one whatever its content type says, in any case
    (`APPLICATION/JSON`, `application/json; charset=latin-1`), or hands its bytes to the 422 handler."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the request body is not UTF-8 text (byte {exc.start})"
    depth = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
        elif char in "]}":
            depth -= 1
    return None


class BodyGuard:
    """Reads a request body before the app does: 413 over `max_bytes` (by Content-Length, or counted while a
    body without one streams in), 400 for a body that is not UTF-8 or nests too deep, whatever its content type
    claims (a check keyed on the type missed `APPLICATION/JSON`); then hands the body to the app."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            size = f"{int(length)} bytes" if length.isdigit() else "the body"
            return await self._reject(send, 413, f"{size} is over the limit of {self.max_bytes} bytes")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._reject(send, 413, f"the body is over the limit of {self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if problem := json_body_problem(body):
            return await self._reject(send, 400, problem)
        given = False

        async def replay():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _reject(send, status: int, detail: str) -> None:
        await JSONResponse({"detail": detail}, status_code=status)({"type": "http"}, None, send)


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Measure:
    """Counts requests and times them by route template (a plain ASGI middleware: cheap)."""

    def __init__(self, app, requests: Counter, latency: Histogram) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = route.path if isinstance(route, APIRoute) else "other"  # unmatched paths share one label
            method = scope["method"] if scope["method"] in _METHODS else "other"  # so do unknown methods
            self.requests.labels(method, path, str(status)).inc()
            self.latency.labels(path).observe(time.perf_counter() - start)


def _finite(value):
    """What a 422 echoes of a rejected input, as JSON can hold it, whatever the input is: inf and NaN as text, a
    lone surrogate (not encodable as UTF-8) and bytes that are not UTF-8 (a body FastAPI did not parse) as their
    escapes, tuples and sets as lists, any other object (an exception in an error's context) as its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {str(_finite(k)): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_finite(v) for v in value]
    return _finite(str(value))


async def _validation_error(request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 (one entry per field, with `loc` and `msg`), safe for any input it echoes. A location in the
    body is given as the body spells it (without the tags of discriminated unions); an unknown field of a job spec
    gets a hint (the near miss it may be, or the kinds of section that have it)."""
    found = list(exc.errors())
    spec = exc.body.get("spec") if isinstance(exc.body, dict) else None
    for e in list(found):  # a section of a wrong kind: the errors the wrong tag would hide, too
        if tuple(e.get("loc", ()))[:2] == ("body", "spec"):
            found += [{**k, "loc": ("body", "spec", *k["loc"])} for k in kind_errors({**e, "loc": e["loc"][2:]}, spec)]
    errors = [
        {**e, "loc": ("body", *input_loc(e["loc"][1:], exc.body, e["type"]))}
        | ({"msg": explain({**e, "loc": e["loc"][2:]})} if e["loc"][1:2] == ("spec",) else {})  # "did you mean"
        if e.get("loc", ())[:1] == ("body",)
        else e
        for e in found
    ]
    return JSONResponse({"detail": _finite(errors)}, status_code=422)  # not jsonable_encoder: it decodes bytes strictly


async def _method_not_allowed(request, exc) -> JSONResponse:
    """405 with an `Allow` header that lists every method of the path, over all its routes (Starlette's names
    only those of the first route that matched the path: GET /jobs and POST /jobs are two routes)."""
    from starlette.routing import Match

    allowed = set()
    for route in request.app.router.routes:
        match, _ = route.matches({**request.scope, "method": "GET"})
        if match != Match.NONE and getattr(route, "methods", None):
            for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"):
                if route.matches({**request.scope, "method": method})[0] == Match.FULL:
                    allowed.add(method)
    allow = ", ".join(sorted(allowed - {"HEAD"} if "GET" not in allowed else allowed))
    return JSONResponse({"detail": "Method Not Allowed"}, status_code=405, headers={"Allow": allow})


class _JobCollector:
    """Scrape-time gauges from the store: jobs by status, and the newest step of each running job."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self):
        by_status = GaugeMetricFamily("miles_jobs", "Jobs in the store, by status.", labels=["status"])
        counts = self.store.count_by_status()
        for status in JobStatus:
            by_status.add_metric([status.value], counts.get(status.value, 0))
        yield by_status
        running, _ = self.store.jobs(status=[JobStatus.RUNNING.value], limit=500)
        last = self.store.last_steps([j.id for j in running])
        steps = GaugeMetricFamily("miles_job_last_step", "Newest completed step of each running job.", labels=["job"])
        for job in running:
            steps.add_metric([str(job.id)], last.get(job.id, 0))
        yield steps


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    store = Store(settings.store_url)
    launcher = Launcher(store, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        launcher.start()
        yield
        launcher.stop()

    app = FastAPI(
        title="Miles",
        version=VERSION,
        summary="Control plane of Miles: jobs, their schedules, metrics, timing spans, events and samples.",
        lifespan=lifespan,
        generate_unique_id_function=lambda route: route.name,  # stable operation ids: the function names
        # Starlette's redirect of `/jobs/` to `/jobs` is an absolute URL built from the request's Host header (any
        # name a client sends); clients here call the paths as published, without the slash, so none is needed
        redirect_slashes=False,
    )
    app.state.settings, app.state.store, app.state.launcher = settings, store, launcher
    app.state.stopping = threading.Event()  # set by `miles serve` on SIGTERM/SIGINT: open event streams end
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(405, _method_not_allowed)
    app.state.token_touched, app.state.token_cache = {}, {}
    app.include_router(router)
    app.include_router(reports_router)

    registry = CollectorRegistry()
    registry.register(_JobCollector(store))
    requests = Counter("miles_http_requests", "HTTP requests served.", ["method", "route", "code"], registry=registry)
    latency = Histogram(
        "miles_http_request_seconds",
        "Time to serve an HTTP request.",
        ["route"],
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        registry=registry,
    )

    app.state.http_requests, app.state.http_latency = requests, latency

    @app.get("/api/v1/health", response_model=Health, tags=["service"], summary="Liveness; needs no token")
    def health() -> Health:
        store_state = launcher.store_problem()
        if store_state == "ok":
            try:
                with store.engine.connect() as conn:
                    conn.execute(text("select 1"))
            except Exception as exc:  # noqa: BLE001 - reported, not raised: health must answer
                store_state = f"error: {type(exc).__name__}"
        ray_state = launcher.ray_problem()
        degraded = store_state != "ok" or ray_state.startswith("error") or launcher.last_error is not None
        return Health(
            status="degraded" if degraded else "ok",
            store=store_state,
            ray=ray_state,
            launcher=settings.launcher,
            launcher_error=launcher.last_error,
            version=VERSION,
        )

    @app.get(
        "/api/v1/presets",
        response_model=list[PresetPublic],
        tags=["jobs"],
        summary="Job specs offered as starting points (the server's presets_dir, *.yaml)",
        responses=documented(401),
    )
    def list_presets(_: ReadToken) -> list[PresetPublic]:
        folder = settings.presets_dir
        files = sorted(folder.glob("*.yaml")) if folder.is_dir() else []
        return [PresetPublic(name=f.stem, spec_yaml=f.read_text()) for f in files if f.stat().st_size < 1 << 20]

    @app.get(
        "/metrics",
        tags=["service"],
        summary="Prometheus metrics",
        response_class=Response,
        responses=documented(401) | {200: {"content": {"text/plain": {}}}},
    )
    def prometheus_metrics(_: ReadToken) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Measure, requests=requests, latency=latency)
    app.add_middleware(BodyGuard, max_bytes=settings.max_body_bytes)
    return app
