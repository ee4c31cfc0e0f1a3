"""Secrets stay out of command lines, logs, events, terminal output and API answers: the store's password travels
to a driver in its environment (readable only by its owner), and every URL that is shown has its password masked."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from miles_control.job.recorder import Recorder
from miles_control.job.redact import mask_credentials
from miles_control.service.driver import STORE_URL_ENV
from miles_control.service.launch.drivers import LocalDriver, ray_job_submission
from miles_control.service.launch.processes import arg_after, cmdline
from miles_control.service.settings import ServerSettings
from miles_control.service.store import Store
from miles_control.testing.servers import PG_ENV, ApiServer, fresh_pg_database

ROOT = Path(__file__).resolve().parents[3]
SECRET = "Pw-7q2xK9z"  # distinctive: found nowhere else in a command line or a log
# A server nothing listens on: the driver starts, then fails to open the store.
UNREACHABLE = f"postgresql+psycopg://miles:{SECRET}@127.0.0.1:9/miles"


@pytest.fixture
def pg_url():
    """A fresh database of the PostgreSQL server MILES_TEST_PG_URL names (its role's password is in the URL)."""
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"PostgreSQL not configured: set {PG_ENV} (e.g. $(bash scripts/postgres.sh))")
    with fresh_pg_database(base) as url:
        yield url


def leaked(url: str) -> str:
    """What a leak of `url`'s password looks like in text: `user:password@` (the test role's password may be a
    common word, so the password alone is not searched for)."""
    parsed = make_url(url)
    return f"{parsed.username}:{parsed.password}@"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (UNREACHABLE, "postgresql+psycopg://miles:***@127.0.0.1:9/miles"),
        ("postgresql://u:s3cr%40t@db.example:5432/jobs", "postgresql://u:***@db.example:5432/jobs"),
        ("postgresql://u:a/b:c@db/jobs?sslmode=require", "postgresql://u:***@db/jobs?sslmode=require"),
        ("postgresql://u@db/jobs", "postgresql://u@db/jobs"),
        ("postgresql://db/jobs?user=u&password=p4ss", "postgresql://db/jobs?user=u&password=***"),
        ("sqlite:///.miles/miles.db", "sqlite:///.miles/miles.db"),
        ("sqlite:////abs/miles.db", "sqlite:////abs/miles.db"),
        ("http://ray:dash-pw@head:8265", "http://ray:***@head:8265"),
        ("https://user:tok@mlflow.example/api?x=1", "https://user:***@mlflow.example/api?x=1"),
        ("redis://:only-pw@cache:6379/0", "redis://:***@cache:6379/0"),
        ("10.0.0.1:6379", "10.0.0.1:6379"),  # a Ray GCS address: nothing to hide
    ],
)
def test_mask_credentials_hides_the_password_of_every_url_shape(url, shown):
    assert mask_credentials(url) == shown
    if url.startswith(("postgresql", "sqlite")) and "?" not in url:  # where the store finds the password
        assert shown == make_url(url).render_as_string(hide_password=True)


def test_mask_credentials_finds_urls_inside_messages():
    message = f"mlflow: http://u:{SECRET}@mlflow:5000 (run 1); store {UNREACHABLE}: cannot open it"
    assert mask_credentials(message) == (
        "mlflow: http://u:***@mlflow:5000 (run 1); "
        "store postgresql+psycopg://miles:***@127.0.0.1:9/miles: cannot open it"
    )


def test_a_local_driver_gets_the_store_url_in_its_environment_not_its_command_line(tmp_path):
    driver = LocalDriver.start(UNREACHABLE, 5, 42, "127.0.0.1:1", tmp_path / "attempt-1.log", {"EXTRA": "1"})
    try:  # read at once: the driver soon exits (its store does not answer)
        deadline = time.time() + 10
        while (args := cmdline(driver.pid)) == [""] and time.time() < deadline:
            time.sleep(0.005)  # /proc shows the command line once the exec is through
        environ = Path(f"/proc/{driver.pid}/environ").read_bytes().decode().split("\0")
    finally:
        driver.kill()
        driver.proc.wait(timeout=30)
    assert not any(SECRET in arg for arg in args), args
    assert "--store" not in args
    # what a re-attached launcher recognises its driver by, in /proc (LocalDriver.alive)
    assert "miles_control.service.driver" in args and arg_after(args, "--attempt-id") == "42"
    assert f"{STORE_URL_ENV}={UNREACHABLE}" in environ and "EXTRA=1" in environ


def test_the_driver_reads_the_store_from_its_environment_and_logs_it_masked():
    env = {**os.environ, STORE_URL_ENV: UNREACHABLE}
    proc = subprocess.run(
        [sys.executable, "-m", "miles_control.service.driver", "--job-id", "3", "--attempt-id", "4"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "store postgresql+psycopg://miles:***@127.0.0.1:9/miles" in out  # which store, without its password
    assert SECRET not in out


def test_a_ray_job_driver_has_the_store_url_in_its_environment_not_its_entrypoint(monkeypatch):
    monkeypatch.setenv("MILES_CACHE", "/cache")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # an earlier test's Ray client may have set it
    settings = ServerSettings(launcher="ray_job", ray_address="http://head:8265", driver_python="/opt/py")
    entrypoint, runtime_env = ray_job_submission(settings, UNREACHABLE, 3, 9)
    assert SECRET not in entrypoint and "--store" not in entrypoint
    assert entrypoint.startswith("/opt/py -m miles_control.service.driver") and "--attempt-id 9" in entrypoint
    assert runtime_env == {"env_vars": {"MILES_CACHE": "/cache", STORE_URL_ENV: UNREACHABLE}}


def test_events_are_recorded_without_url_passwords(tmp_path):
    """A tracker's link (an MLflow URI with user:password) or an error quoting a URL, as every API reader sees it."""
    store = Store(f"sqlite:///{tmp_path}/miles.db")
    recorder = Recorder(store, store.create_job("j", {}))
    link = f"http://u:{SECRET}@mlflow:5000"
    recorder.event("tracking", f"mlflow: {link} (experiment e)", type="mlflow", link=link, more=[{"uri": link}])
    [event] = [e for e in store.events(recorder.job_id) if e.kind == "tracking"]
    assert SECRET not in event.message and SECRET not in repr(event.data)
    assert event.data["link"] == "http://u:***@mlflow:5000"


@pytest.mark.postgres
def test_serve_and_health_show_no_store_password(pg_url, tmp_path):
    """`miles serve` names its store at start-up; /api/v1/health (no token needed) reports on it."""
    server = ApiServer(pg_url, tmp_path, launcher="off").start()
    try:
        health = httpx.get(f"{server.url}/api/v1/health", timeout=10)
    finally:
        server.stop()
    log = server.log.read_text()
    assert health.status_code == 200 and health.json()["store"] == "ok"
    assert mask_credentials(pg_url) in log  # the store it serves, named
    assert leaked(pg_url) not in log and leaked(pg_url) not in health.text


@pytest.mark.postgres
def test_miles_run_prints_and_records_no_store_password(pg_url, monkeypatch):
    """`miles run` on a PostgreSQL store: its output, and the spec it records (which the API shows with the job),
    carry no password. The run itself is a stand-in that records the spec it is given as `run_job` does."""
    import miles_control.job.run
    from miles_control.cli.main import app

    def run_job(spec, store, **_):
        return store.create_job(spec.name, spec.model_dump(mode="json"))

    monkeypatch.setattr(miles_control.job.run, "run_job", run_job)
    config = ROOT / "examples" / "arithmetic.yaml"
    result = CliRunner().invoke(app, ["run", str(config), "--quiet", "--set", f"store.url={pg_url}"])
    assert result.exit_code == 0, result.output
    assert f"store: {mask_credentials(pg_url)}" in result.output
    assert leaked(pg_url) not in result.output
    store = Store(pg_url)
    [job] = store.jobs()[0]
    assert job.spec["store"]["url"] == mask_credentials(pg_url)
    store.engine.dispose()
