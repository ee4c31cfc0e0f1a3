"""Hostile requests to a real `miles serve` get a 4xx, never a 500, and leave the connection usable; no response
echoes the Host a client chose (issue 54, second round).

One server on SQLite for the module: everything here is refused before the store is asked anything."""

import asyncio
import json

import httpx
import pytest
from fastapi.exceptions import RequestValidationError

from miles_control.service.api.app import _validation_error
from miles_control.service.store import Store
from miles_control.service.store.tokens import create_token
from miles_control.testing.servers import ApiServer

DEEP = b"[" * 700 + b"]" * 700
BODIES = {
    "not-utf8": b"\xff\xfe{",
    "utf16-json": '{"spec": {"name": "x"}}'.encode("utf-16"),
    "deep-array": DEEP,
    "deep-in-spec": b'{"spec": {"name": "x", "seed": ' + DEEP + b"}}",
    "lone-surrogate": b'{"spec": {"name": "\\ud800"}, "max_staleness": "\\udfff"}',
    "huge-float": b'{"spec": {"name": "x", "seed": 1e999}, "max_staleness": -1e999}',
    "form": b"spec=x&a%5Bb%5D=1",
    "empty": b"",
}
CONTENT_TYPES = [
    None,
    "text/plain",
    "application/json",
    "APPLICATION/JSON",
    "application/json; charset=latin-1",
    "Application/Json ; charset=UTF-16",
    "application/merge-patch+JSON",
    "multipart/form-data",
    "application/x-www-form-urlencoded",
]
ROUTES = [
    ("POST", "/api/v1/jobs"),
    ("POST", "/api/v1/jobs/validate"),
    ("PATCH", "/api/v1/jobs/{job}/schedule"),
    ("POST", "/api/v1/jobs/{job}/cancel"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`miles serve` (launcher off) with an admin token and one queued job to aim the job routes at."""
    folder = tmp_path_factory.mktemp("hardening")
    store_url = f"sqlite:///{folder}/miles.db"
    store = Store(store_url)
    _, admin = create_token(store, "admin", "admin")
    job = store.create_job("target", {"name": "target"}, source="api")
    api = ApiServer(store_url, folder, launcher="off", cpus="2").start()
    yield api.url, {"Authorization": f"Bearer {admin}"}, job
    api.stop()
    store.engine.dispose()


@pytest.mark.parametrize("method,route", ROUTES)
@pytest.mark.parametrize("content_type", CONTENT_TYPES)
@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
def test_no_body_gets_a_5xx_and_the_connection_stays_usable(server, method, route, content_type, body):
    url, admin, job = server
    headers = admin | ({"content-type": content_type} if content_type else {})
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.request(method, route.format(job=job), headers=headers, content=body)
        assert r.status_code < 500, (r.status_code, r.text[:500])  # cancel takes no body: it may ignore one (200)
        r.json()  # an answer in JSON, not a bare error page
        assert client.get("/api/v1/jobs", headers=admin, params={"limit": 1}).status_code == 200  # same connection


def test_an_oversized_body_gets_413_and_the_connection_stays_usable(server):
    url, admin, _ = server
    with httpx.Client(base_url=url, timeout=30) as client:
        for content_type in (None, "text/plain", "APPLICATION/JSON"):
            headers = admin | ({"content-type": content_type} if content_type else {})
            r = client.post("/api/v1/jobs", headers=headers, content=b"[" * ((1 << 20) + 1))
            assert r.status_code == 413, r.text[:500]
            assert client.get("/api/v1/jobs", headers=admin).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xfe{",
        bytearray(b"\x80"),
        "text with a lone surrogate \ud800",
        {"spec": {"name": ("x", float("inf")), "tags": {b"\xc3", frozenset({1})}}, b"\xff": None},
        [ValueError("not JSON"), object()],
    ],
    ids=["bytes", "bytearray", "surrogate", "nested", "objects"],
)
def test_the_422_handler_copes_with_any_body(body):
    """FastAPI hands the handler the raw bytes of a body it did not parse as JSON; errors can hold any object."""
    errors = [
        {"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary", "input": body},
        {"type": "extra_forbidden", "loc": ("body", "spec", "bogus"), "msg": "Extra inputs", "input": body},
        {"type": "value_error", "loc": ("query", "x"), "msg": "bad", "input": body, "ctx": {"error": ValueError("x")}},
    ]
    response = asyncio.run(_validation_error(None, RequestValidationError(errors, body=body)))
    assert response.status_code == 422
    detail = json.loads(response.body)["detail"]
    assert [e["loc"][0] for e in detail] == ["body", "body", "query"]


HOSTILE_HOST = "evil.example"
PROBES = [
    ("GET", "/api/v1/jobs/"),
    ("GET", "/api/v1/jobs/{job}/"),
    ("GET", "/api/v1/jobs/{job}/events/"),
    ("POST", "/api/v1/jobs/"),
    ("PATCH", "/api/v1/jobs/{job}/schedule/"),
    ("GET", "/api/v1/health/"),
    ("GET", "/api/v1/presets/"),
    ("GET", "/metrics/"),
    ("GET", "/docs/"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/api/v1/jobs"),
    ("GET", "/no/such/path/"),
    ("DELETE", "/api/v1/jobs"),
]


@pytest.mark.parametrize("method,route", PROBES)
def test_no_response_reflects_the_host_a_client_sent(server, method, route):
    """Starlette's slash redirect built an absolute Location from Host: `GET /api/v1/jobs/` with `Host: evil.example`
    sent the client to http://evil.example/api/v1/jobs."""
    url, admin, job = server
    headers = admin | {"Host": HOSTILE_HOST, "X-Forwarded-Host": HOSTILE_HOST, "X-Forwarded-Proto": "https"}
    r = httpx.request(method, url + route.format(job=job), headers=headers, timeout=30)
    assert r.status_code < 500 and not 300 <= r.status_code < 400, (r.status_code, r.headers)
    shown = " ".join(f"{k}: {v}" for k, v in r.headers.items()) + r.text
    assert HOSTILE_HOST not in shown, (r.status_code, r.headers)


def test_paths_as_published_still_answer(server):
    """No slash redirect: the paths the client and the dashboard call (without the slash) work as before."""
    url, admin, job = server
    assert httpx.get(f"{url}/api/v1/jobs", headers=admin).status_code == 200
    assert httpx.get(f"{url}/api/v1/jobs/{job}", headers=admin).status_code == 200
    assert httpx.get(f"{url}/api/v1/jobs/", headers=admin).status_code == 404
