"""Issue 54, findings 2, 3 (checkpoints) and 6 (budget, health): two servers on one store, fenced drivers, one CPU
budget per host, checkpoints pruned, /health that says when the store cannot be written or Ray does not answer.
Each runs on SQLite and, where MILES_TEST_PG_URL names a server, on PostgreSQL."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from miles_control.job.status import FencedOut, JobStatus
from miles_control.service.launch.launcher import Launcher
from miles_control.service.settings import ServerSettings
from miles_control.service.store import AttemptConflict, Store
from miles_control.spec.config import JobSpec


def running_job(store: Store, host: str, pid: int = 999_999) -> tuple[int, int]:
    """A job `running` under a live local attempt of `host` (as the primary server's launcher leaves it)."""
    spec = JobSpec.model_validate({"name": "live"}).model_dump(mode="json")
    job = store.create_job("live", spec, source="api")
    attempt = store.admit(job, "local", host, budget=64, demand_of=lambda spec: 1.0)
    assert attempt is not None
    store.update_attempt(attempt.id, driver_pid=pid, status="running")
    store.set_status(job, JobStatus.RUNNING)
    driver = store.fenced(attempt.id)
    for step in (1, 2):
        driver.add_step(job, step, step, 0.0, 1.0)
        driver.add_metrics(job, step, {"loss": 1.0 / step})
    driver.add_checkpoint(job, 2, 2, "/ckpt/2")
    return job, attempt.id


def test_a_second_server_judges_no_attempt_it_cannot_see(store_url, tmp_path):
    """Finding 2: a server started with `--launcher off` (or launching on another host) on a shared store left the
    primary's live jobs running; before, its re-attach failed them as lost while their drivers kept running."""
    store = Store(store_url)
    job, attempt = running_job(store, host="primary-host.example")
    inline, _ = running_job(store, host="primary-host.example")
    store.update_attempt(store.attempts(inline)[0].id, launcher="inline")
    for launcher in ("off", "local", "ray_job"):
        settings = ServerSettings(store_url=store_url, data_dir=tmp_path / launcher, launcher=launcher, cpus=2)
        second = Launcher(Store(store_url), settings)
        second.reattach()  # what create_app's start-up does
        assert second.drivers == {}
    assert store.job(job).status == "running" and store.attempt(attempt).status == "running"
    assert store.job(inline).status == "running"
    assert [s.step for s in store.steps(job)] == [1, 2] and len(store.checkpoints(job)) == 1
    store.engine.dispose()


def test_a_server_still_judges_its_own_hosts_lost_driver(store_url, tmp_path):
    """The other side of the rule: a local attempt of this host whose driver is gone is failed, resumable."""
    store = Store(store_url)
    job, attempt = running_job(store, host=socket.gethostname(), pid=2**22 + 7)  # no such process
    settings = ServerSettings(store_url=store_url, data_dir=tmp_path, launcher="local", cpus=2)
    Launcher(store, settings).reattach()
    assert store.attempt(attempt).status == "ended"
    row = store.job(job)
    assert row.status == "failed" and "resumable (resume starts after step 2)" in row.error
    store.engine.dispose()


def test_a_second_driver_on_a_live_job_is_refused_by_the_store(store_url):
    """Finding 2: two drivers on one job mixed two runs. The store allows one live attempt per job, and a driver
    whose attempt was ended or replaced cannot write: its rows of the job stay as the live attempt wrote them."""
    store = Store(store_url)
    job, attempt = running_job(store, host="h1")
    with pytest.raises(AttemptConflict, match="already has a live attempt"):
        store.start_attempt(job, "local")
    with pytest.raises(AttemptConflict):
        store.start_attempt(job, "inline", driver_pid=1, driver_host="h2")
    stale = store.fenced(attempt)
    # the attempt is judged lost (its job failed), the job resumed: a new attempt owns it
    store.end_attempt(attempt, "its driver was lost")
    store.set_status(job, JobStatus.FAILED, error="lost")
    store.resume(job)
    second = store.start_attempt(job, "local")
    for write in (
        lambda: stale.add_metrics(job, 3, {"loss": 0.0}),
        lambda: stale.add_step(job, 3, 3, 0.0, 1.0),
        lambda: stale.add_checkpoint(job, 3, 3, "/ckpt/3"),
        lambda: stale.discard_from(job, 0),
        lambda: stale.add_event(job, "x", "y"),
        lambda: stale.set_status(job, JobStatus.STARTING),
        lambda: stale.update_attempt(attempt, status="running"),
        lambda: stale.end_attempt(attempt, "succeeded"),
    ):
        with pytest.raises(FencedOut, match=f"attempt {attempt} no longer owns the job"):
            write()
    assert [s.step for s in store.steps(job)] == [1, 2] and [c.step for c in store.checkpoints(job)] == [2]
    assert store.job(job).status == "queued" and store.attempt(attempt).exit_reason == "its driver was lost"
    owner = store.fenced(second.id)  # the live attempt writes as before
    owner.add_metrics(job, 3, {"loss": 0.3})
    assert (3, 0.3) in store.metric_series(job, "loss")
    store.engine.dispose()


def test_two_servers_share_one_cpu_budget_per_host(store_url, tmp_path):
    """Finding 6: two API servers on one store ran 4 jobs at once against a 2-CPU budget. Admission is one
    transaction that counts every live attempt of the host, whichever server launched it."""
    store = Store(store_url)
    spec = JobSpec.model_validate({"name": "q", "ray": {"trainer_cpus_per_rank": 0.5, "rollout_cpus": 0.5}})
    jobs = [store.create_job(f"q{i}", spec.model_dump(mode="json"), source="api") for i in range(4)]
    servers = [Store(store_url) for _ in range(2)]
    admitted = []
    for job in jobs:  # the two servers take turns, as their launchers' ticks interleave
        server = servers[len(admitted) % 2]
        attempt = server.admit(job, "local", "host-a", budget=2.0, demand_of=lambda s: 1.0)
        if attempt is not None:
            admitted.append(job)
    assert admitted == jobs[:2]
    assert [store.job(j).status for j in jobs] == ["starting", "starting", "queued", "queued"]
    # another host has its own budget; a finished attempt frees its share
    assert store.admit(jobs[2], "local", "host-b", budget=2.0, demand_of=lambda s: 1.0) is not None
    store.end_attempt(store.attempts(jobs[0])[0].id, "done")
    assert store.admit(jobs[3], "local", "host-a", budget=2.0, demand_of=lambda s: 1.0) is not None
    for s in (store, *servers):
        s.engine.dispose()


def test_checkpoints_are_pruned_to_what_the_schedule_keeps(tmp_path):
    """Finding 3: a job's checkpoints were never pruned. The recorder keeps `schedule.keep_checkpoints`, the
    newest, and deletes the others' folders and rows; a step saved twice keeps its folder."""
    from miles_control.job.recorder import Recorder

    store = Store(f"sqlite:///{tmp_path}/miles.db")
    job = store.create_job("ckpt", {})
    recorder = Recorder(store, job)
    folders = []
    for step in (10, 20, 30, 30, 40):
        folder = tmp_path / f"step-{step}"
        folder.mkdir(exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"x" * 1024)
        folders.append(folder)
        recorder.checkpoint(step, step, folder, keep=2)
    assert [c.step for c in store.checkpoints(job)] == [30, 40]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-30", "step-40"]
    pruned = [e.message for e in store.events(job) if e.kind == "checkpoint_pruned"]
    assert len(pruned) == 2 and "keep_checkpoints=2" in pruned[0]
    assert JobSpec.model_validate({"name": "x"}).schedule.keep_checkpoints == 2
    store.engine.dispose()


def test_health_says_when_the_store_cannot_be_written_or_ray_does_not_answer(tmp_path, monkeypatch):
    """Finding 6: after a failed store write (a full disk) /health still said ok. It reports the write failure,
    a SQLite disk without room, and a Ray instance that does not answer."""
    from fastapi.testclient import TestClient
    from sqlalchemy.exc import OperationalError

    from miles_control.service.api.app import create_app
    from miles_control.service.launch import launcher as launcher_module

    settings = ServerSettings(store_url=f"sqlite:///{tmp_path}/m.db", data_dir=tmp_path, launcher="local", cpus=2)
    app = create_app(settings)
    launcher = app.state.launcher
    full = []

    def tick() -> None:  # from now on, store writes fail as on a full disk
        if full:
            raise OperationalError("insert", {}, Exception("database or disk is full"))

    launcher.tick = tick
    with TestClient(app) as client:
        health = client.get("/api/v1/health").json()
        assert health["status"] == "ok" and health["ray"] == "not started", health
        full.append(True)
        launcher._stop.wait(2.5)  # a tick of the launcher's thread
        health = client.get("/api/v1/health").json()
        assert health["status"] == "degraded" and "disk is full" in health["store"], health
        monkeypatch.setattr(launcher_module, "MIN_FREE_BYTES", 1 << 62)
        launcher._last_exc = None
        assert "bytes free on the store's disk" in client.get("/api/v1/health").json()["store"]
        state = tmp_path / "ray.json"  # a head that is gone (the server would stop its process group at exit)
        state.write_text('{"address": "127.0.0.1:9", "pgid": 4194000}')
        health = client.get("/api/v1/health").json()
        state.unlink()
        assert health["ray"].startswith("error: the local Ray head at 127.0.0.1:9 does not answer"), health


def test_a_ray_head_that_cannot_start_fails_with_its_cause(tmp_path, monkeypatch):
    """Finding 6: a Ray head that could not start failed the job a minute later with a ConnectionError. The launch
    fails at once, and the error carries the head's own last log lines."""
    import sys

    from miles_control.service.launch.local_ray import LocalRay

    fake_ray = tmp_path / "bin" / "ray"
    fake_ray.parent.mkdir()
    fake_ray.write_text("#!/bin/sh\necho 'ValueError: the node IP cannot be determined' >&2\nexit 1\n")
    fake_ray.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    ray = LocalRay(ServerSettings(data_dir=tmp_path, cpus=2))
    with pytest.raises(RuntimeError, match="did not start: ValueError: the node IP cannot be determined"):
        ray.address()
    assert not Path(tmp_path / "ray.json").exists()
