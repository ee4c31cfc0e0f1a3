"""Real jobs through the REST API: launched as drivers on the local Ray instance, queued while CPUs are
busy, cancelled, resumed from a checkpoint, and surviving kill -9 of the API server."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from miles_control.service.store import Store
from miles_control.service.store.tokens import create_token
from miles_control.testing.servers import (
    PG_ENV,
    ApiServer,
    fresh_pg_database,
    ray_cluster_with_dashboard,
    stop_local_ray,
)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def small_spec(name: str, num_steps: int, **schedule) -> dict:
    """The demo's workload (same cached model), made small: the in-process engine, 16 prompts a step."""
    spec = yaml.safe_load((ROOT / "examples" / "arithmetic.yaml").read_text())
    spec["name"] = name
    spec["rollout"]["engine"] = {"type": "hf"}
    spec["rollout"]["num_prompts_per_step"] = 16
    spec["rollout"]["eval"] = {"every_steps": 5, "num_prompts": 50}
    spec["schedule"] = {"type": "sync", "num_steps": num_steps, **schedule}
    return spec


class Client:
    def __init__(self, server: ApiServer, token: str) -> None:
        self.server, self.headers = server, {"Authorization": f"Bearer {token}"}

    def call(self, method: str, path: str, **kw):
        r = httpx.request(method, self.server.url + "/api/v1" + path, headers=self.headers, timeout=30, **kw)
        assert r.status_code < 400, f"{method} {path}: {r.status_code} {r.text}"
        return r.json() if r.headers["content-type"].startswith("application/json") else r.text

    def job(self, job_id: int) -> dict:
        return self.call("GET", f"/jobs/{job_id}")

    def wait(self, job_id: int, until, timeout: float = 300.0, what: str = "") -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            if job["status"] in ("failed", "succeeded", "cancelled") and not until(job):
                logs = self.call("GET", f"/jobs/{job_id}/logs") if job["attempts"] else ""
                raise AssertionError(
                    f"job {job_id} ended {job['status']} ({job['error']}) before {what}\n{logs[-3000:]}"
                )
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not {what} after {timeout}s: {self.job(job_id)}")


@pytest.fixture
def plane(tmp_path, request):
    """A store (SQLite, or PostgreSQL when the test is parametrized so), a token, and API servers on it."""
    servers: list[ApiServer] = []
    stores: list[Store] = []
    pg = getattr(request, "param", "sqlite") == "postgresql"
    if pg and not os.environ.get(PG_ENV):
        pytest.skip(f"PostgreSQL not configured: set {PG_ENV}")

    def run(url: str):
        store = Store(url)
        stores.append(store)
        _, token = create_token(store, "test", "admin")

        def start(env: dict[str, str] | None = None, wrapper: list[str] | None = None, **settings) -> Client:
            settings = {"poll_interval_s": "0.3", "cpus": "1", **settings}
            server = ApiServer(url, tmp_path, env=env, wrapper=wrapper, **settings).start()
            servers.append(server)
            return Client(server, token)

        return store, start

    def cleanup() -> None:
        for server in servers:
            server.stop()
        for store in stores:  # a failed test may leave drivers behind: they must not outlive it
            for attempt in store.attempts(live_only=True):
                if attempt.driver_pid:
                    try:
                        os.killpg(attempt.driver_pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            store.engine.dispose()
        stop_local_ray(tmp_path)

    if pg:
        with fresh_pg_database(os.environ[PG_ENV]) as url:
            try:
                yield run(url)
            finally:
                cleanup()
    else:
        try:
            yield run(f"sqlite:///{tmp_path}/miles.db")
        finally:
            cleanup()


@pytest.mark.parametrize(
    "plane",
    [
        pytest.param("sqlite", marks=pytest.mark.extended),  # the other tests here run the API on SQLite
        pytest.param("postgresql", marks=pytest.mark.postgres),
    ],
    indirect=True,
)
def test_jobs_queue_run_cancel_and_resume_through_the_api(plane):
    store, start = plane
    api = start()  # 1 CPU: one job (0.5 trainer + 0.5 rollout) at a time
    first = api.call("POST", "/jobs", json={"spec": small_spec("long", 40, checkpoint_every=2)})["id"]
    second = api.call("POST", "/jobs", json={"spec": small_spec("short", 3)})["id"]
    api.wait(first, lambda j: j["status"] == "running" and (j["last_step"] or 0) >= 3, what="past step 3")
    assert api.job(second)["status"] == "queued"  # waits for the CPUs of the first

    # A live schedule change of the running job: applied at its next step, and recorded.
    change = api.call("PATCH", f"/jobs/{first}/schedule", json={"pause_mode": "retract"})
    deadline = time.time() + 120
    while (changes := api.call("GET", f"/jobs/{first}/schedule-changes"))[0]["status"] == "pending":
        assert time.time() < deadline, changes
        time.sleep(0.3)
    assert changes[0]["id"] == change["id"] and changes[0]["status"] == "applied" and changes[0]["applied_step"] > 3
    events = api.call("GET", f"/jobs/{first}/events")
    assert any(e["kind"] == "schedule_change" and "in_place → retract" in e["message"] for e in events)

    api.call("POST", f"/jobs/{first}/cancel")
    cancelled = api.wait(first, lambda j: j["status"] == "cancelled", what="cancelled")
    assert cancelled["error"] == "cancelled" and cancelled["resumable"]
    assert cancelled["checkpoints"], "checkpoint_every=2 saved none"

    done = api.wait(second, lambda j: j["status"] == "succeeded", what="succeeded")
    assert done["last_step"] == 3 and done["attempts"][0]["launcher"] == "local"
    stages = {s["stage"] for s in api.call("GET", f"/jobs/{second}/spans")}
    assert {"rollout", "train", "weight_sync", "eval"} <= stages
    accuracy = api.call("GET", f"/jobs/{second}/metrics", params={"name": "eval/accuracy"})
    assert [p["step"] for p in accuracy] == [0, 3] and all(0 <= p["value"] <= 1 for p in accuracy)
    samples = api.call("GET", f"/jobs/{second}/samples", params={"step": 2})
    assert 1 <= len(samples) <= 4 and all(s["prompt"] and "reward" in s for s in samples)
    assert "step 3 done" in api.call("GET", f"/jobs/{second}/logs")  # (the status is set before the last line)

    resume_after = cancelled["checkpoints"][-1]["step"]
    api.call("POST", f"/jobs/{first}/resume")
    done = api.wait(first, lambda j: j["status"] == "succeeded", what="succeeded after resume")
    assert [a["resume_step"] for a in done["attempts"]] == [0, resume_after]
    assert [s["step"] for s in api.call("GET", f"/jobs/{first}/steps")] == list(range(1, 41))  # each step once
    syncs = api.call("GET", f"/jobs/{first}/spans", params={"stage": "weight_sync"})
    assert all(s["attrs"]["trainer_fingerprint"] == s["attrs"]["engine_fingerprint"] for s in syncs)
    # The resumed attempt pushed exactly the weights the first one had after the checkpoint's step.
    at_checkpoint = [s["attrs"]["trainer_fingerprint"] for s in syncs if s["step"] == resume_after]
    assert len(at_checkpoint) == 2 and at_checkpoint[0] == at_checkpoint[1]
    restore = api.call("GET", f"/jobs/{first}/spans", params={"stage": "restore"})
    assert [s["step"] for s in restore] == [resume_after]
    kinds = [e["kind"] for e in api.call("GET", f"/jobs/{first}/events")]
    assert "resume" in kinds and kinds.count("launched") == 2


@pytest.mark.parametrize("plane", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True)
def test_a_second_server_and_a_second_driver_leave_a_live_job_intact(plane):
    """Issue 54, finding 2: a second API server with `--launcher off` on another host, started on the shared
    PostgreSQL store while a job runs, judged the job's attempt lost and failed it; a resume then ran two drivers on
    one job. Now the second server leaves the job alone, the store refuses a second attempt while one is live, and a
    driver whose attempt was ended behind its back (the old fault's path, forced here) writes nothing more: the job
    ends with one run's rows."""
    from miles_control.job.status import JobStatus
    from miles_control.service.store import AttemptConflict

    store, start = plane
    api = start()
    spec = small_spec("shared", 16, checkpoint_every=4)
    spec["rollout"]["eval"]["every_steps"] = 8
    job = api.call("POST", "/jobs", json={"spec": spec})["id"]
    api.wait(job, lambda j: (j["last_step"] or 0) >= 2, what="past step 2")
    other_host = ["unshare", "--uts", "sh", "-c", 'hostname other-host && exec "$@"', "sh"]
    other = start(wrapper=other_host, launcher="off")  # it answers once its start-up re-attach has run
    for client in (api, other):
        seen = client.job(job)
        assert seen["status"] == "running" and seen["attempts"][0]["status"] != "ended", seen
    with pytest.raises(AttemptConflict, match="already has a live attempt"):
        store.start_attempt(job, "local")

    first = api.wait(job, lambda j: len(j["checkpoints"]) >= 1, what="checkpointed")["attempts"][0]
    store.end_attempt(first["id"], "ended behind its driver's back")  # what the faulty re-attach did
    store.set_status(job, JobStatus.FAILED, error="forced")
    api.call("POST", f"/jobs/{job}/resume")  # a second driver starts while the first still runs
    done = api.wait(job, lambda j: j["status"] == "succeeded", timeout=600, what="succeeded after the resume")
    assert [a["exit_reason"] for a in done["attempts"]] == ["ended behind its driver's back", "succeeded"]
    assert [s["step"] for s in api.call("GET", f"/jobs/{job}/steps")] == list(range(1, 17))  # each step once
    steps = [c["step"] for c in done["checkpoints"]]
    assert steps == sorted(set(steps)), steps  # no checkpoint recorded twice
    log = api.call("GET", f"/jobs/{job}/logs", params={"attempt": 1})
    assert "no longer owns the job" in log, log[-2000:]


def test_kill_9_of_the_api_loses_nothing(plane, tmp_path):
    store, start = plane
    api = start()
    durable = small_spec("durable", 40, checkpoint_every=5)
    durable["rollout"]["eval"]["every_steps"] = 20  # the job only has to outlive the API; few evals keep it short
    job = api.call("POST", "/jobs", json={"spec": durable})["id"]
    api.wait(job, lambda j: (j["last_step"] or 0) >= 2, what="past step 2")
    seen = api.call("GET", f"/jobs/{job}/metrics")
    events = api.call("GET", f"/jobs/{job}/events")
    api.server.kill()  # kill -9 while the job runs
    api = start()  # a new server process on the same store and state folder
    job_now = api.job(job)
    assert job_now["status"] == "running", job_now  # 38 steps to go: the driver outlived the API
    kinds = [e["kind"] for e in api.call("GET", f"/jobs/{job}/events")]
    assert "reattached" in kinds
    done = api.wait(job, lambda j: j["status"] == "succeeded", what="succeeded after the API restart")
    after = {(p["name"], p["step"], p["value"]) for p in api.call("GET", f"/jobs/{job}/metrics")}
    assert {(p["name"], p["step"], p["value"]) for p in seen} <= after  # everything acknowledged is there
    assert {e["id"] for e in events} <= {e["id"] for e in api.call("GET", f"/jobs/{job}/events")}
    assert done["last_step"] == 40

    # The API and the job's driver both die: the restarted API marks the job failed and resumable.
    lost_spec = small_spec("lost", 20, checkpoint_every=2)
    lost_spec["rollout"]["eval"]["every_steps"] = 10
    lost = api.call("POST", "/jobs", json={"spec": lost_spec})["id"]
    running = api.wait(lost, lambda j: (j["last_step"] or 0) >= 3, what="past step 3")
    api.server.kill()
    os.killpg(running["attempts"][-1]["driver_pid"], signal.SIGKILL)
    api = start()
    failed = api.job(lost)
    assert failed["status"] == "failed" and failed["resumable"], failed
    assert "driver process is gone" in failed["error"] and "resumable" in failed["error"]
    api.call("POST", f"/jobs/{lost}/resume")
    done = api.wait(lost, lambda j: j["status"] == "succeeded", what="succeeded after resume")
    assert done["attempts"][-1]["resume_step"] >= 2 and done["last_step"] == 20


def test_the_api_client_example_runs(plane):
    """examples/api_client.py on SGLang: launch, follow the event stream to the end, read spans and metrics; then the
    API serves the SGLang server's own log beside the driver's (the Logs tab's sources)."""
    store, start = plane
    api = start(cpus="2")
    token = api.headers["Authorization"].removeprefix("Bearer ")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "api_client.py"), "--api", api.server.url, "--token", token,
         "--steps", "3", "--engine", "sglang"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "job 1: succeeded after 3 steps" in out
    assert "[status] queued → starting" in out and "[status] running → succeeded" in out
    assert "weight_sync" in out and "held-out accuracy by step: 0:" in out
    sources = api.call("GET", "/jobs/1/logs/sources")
    assert [s["name"] for s in sources] == ["driver", "engine-0"] and all(s["size_bytes"] > 0 for s in sources)
    engine_log = api.call("GET", "/jobs/1/logs", params={"source": "engine-0"})
    assert "The server is fired up and ready to roll!" in engine_log  # SGLang's own line, not the driver's
    assert "The server is fired up" not in api.call("GET", "/jobs/1/logs")
    r = httpx.get(api.server.url + "/api/v1/jobs/1/logs", params={"source": "engine-7"}, headers=api.headers)
    assert r.status_code == 404 and "no engine-7 log" in r.json()["detail"]


@pytest.mark.skipif(importlib.util.find_spec("aiohttp_cors") is None, reason="ray[default] (the dashboard) missing")
def test_jobs_submitted_to_a_ray_cluster(plane, tmp_path):
    """launcher ray_job: drivers go through Ray's job submission API to a cluster (a head on this machine)."""
    store, start = plane
    with ray_cluster_with_dashboard(tmp_path / "cluster") as dashboard:
        api = start(
            env={"RAY_AUTH_MODE": "token"},
            launcher="ray_job",
            ray_address=dashboard,
            driver_python=sys.executable,
            cpus="2",
        )
        # the cluster's GPUs (none: a head without --num-gpus here) are asked of its dashboard at submission
        gpu_spec = small_spec("needs-a-gpu", 3) | {"resources": {"trainer_gpus_per_rank": 1}}
        r = httpx.post(api.server.url + "/api/v1/jobs", headers=api.headers, json={"spec": gpu_spec}, timeout=30)
        assert r.status_code == 422, r.text
        [problem] = r.json()["detail"]
        assert problem["loc"] == ["body", "spec", "resources"]
        assert f"needs 1 GPU(s) (trainer 1 × 1) but the Ray cluster at {dashboard} has 0" in problem["msg"]
        short = api.call("POST", "/jobs", json={"spec": small_spec("on-ray", 3)})["id"]
        done = api.wait(short, lambda j: j["status"] == "succeeded", what="succeeded on the cluster")
        [attempt] = done["attempts"]
        assert attempt["launcher"] == "ray_job" and attempt["submission_id"].startswith(f"miles-job-{short}-")
        assert "step 3 done" in api.call("GET", f"/jobs/{short}/logs")  # from Ray's job logs
        assert {"rollout", "train", "weight_sync"} <= {s["stage"] for s in api.call("GET", f"/jobs/{short}/spans")}

        long = api.call("POST", "/jobs", json={"spec": small_spec("cancel-on-ray", 40)})["id"]
        api.wait(long, lambda j: (j["last_step"] or 0) >= 2, what="past step 2")
        api.call("POST", f"/jobs/{long}/cancel")
        cancelled = api.wait(long, lambda j: j["status"] == "cancelled", what="cancelled")
        assert cancelled["error"] == "cancelled" and cancelled["last_step"] < 40
