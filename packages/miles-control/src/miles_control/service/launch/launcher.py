"""The launcher: starts queued jobs as drivers while their CPUs are free, watches them, cancels them,
and after a restart of the API re-attaches to the drivers that kept running.

Job rows are the truth: the driver moves its job to running and to its end; the launcher marks a job
failed only when its driver is gone without having done so."""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
from datetime import timezone
from pathlib import Path

from miles_control.service.launch.drivers import (
    Driver,
    InlineRun,
    LocalDriver,
    RayJobDriver,
    driver_store_url,
    engine_log_dir,
)
from miles_control.service.launch.local_ray import LocalRay
from miles_control.service.settings import ServerSettings
from miles_control.service.store import FINAL, Attempt, InvalidTransition, JobStatus, Store
from miles_control.spec.config import JobSpec

log = logging.getLogger(__name__)
MIN_FREE_BYTES = 16 << 20  # below this a SQLite store's next transaction may fail: /health says so first


def _demand_of(spec: dict) -> float:
    return job_demand(JobSpec.model_validate(spec))


def job_demand(spec: JobSpec) -> float:
    """CPUs the job's actors reserve on Ray: every trainer rank, plus the rollout actor (the launcher admits a job
    when they fit; the API refuses one that never could)."""
    return spec.train.backend.world_size * spec.ray.trainer_cpus_per_rank + spec.ray.rollout_cpus


class Launcher:
    """One thread in the API process; every `poll_interval_s` it reaps, cancels and launches."""

    def __init__(self, store: Store, settings: ServerSettings) -> None:
        self.store, self.settings = store, settings
        self.ray = LocalRay(settings)
        self.drivers: dict[int, Driver] = {}  # attempt id → driver
        self._term_sent: dict[int, float] = {}  # attempt id → when the cancel was sent
        self._failed_launches: dict[int, tuple[Attempt, str]] = {}  # whose failure could not be stored yet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="miles-launcher", daemon=True)
        self.last_error: str | None = None
        self._last_exc: Exception | None = None

    # --- life of the thread ---------------------------------------------------------------------
    def start(self) -> None:
        self.reattach()
        if self.settings.launcher != "off":
            self._thread.start()

    def stop(self) -> None:
        """Stop launching; the local Ray instance stops too unless drivers still use it (they outlive us)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if not self.store.attempts(live_only=True):
            self.ray.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self.last_error, self._last_exc = None, None
            except Exception as exc:  # noqa: BLE001 - keep launching; the error is visible on /health
                log.exception("launcher tick failed")
                self.last_error, self._last_exc = f"{type(exc).__name__}: {exc}", exc
            self._stop.wait(self.settings.poll_interval_s)

    # --- the work -------------------------------------------------------------------------------
    def reattach(self) -> None:
        """After a restart: keep watching drivers that still run; fail the jobs of drivers that are gone,
        and of launches the restart interrupted (a job `starting` with no attempt)."""
        for attempt in self.store.attempts(live_only=True):
            try:
                if self._launch_interrupted(attempt):
                    self._fail(attempt, "launch interrupted by a restart of the API")
                    continue
                driver = self._driver_of(attempt)
                if driver is None:
                    continue  # another server's launcher, another host, or a `miles run` elsewhere: not ours to judge
                if driver is not None and driver.alive():
                    self.drivers[attempt.id] = driver
                    self.store.add_event(attempt.job_id, "reattached", f"attempt {attempt.number}: driver re-attached")
                    log.info("job %d: re-attached to attempt %d", attempt.job_id, attempt.number)
                else:
                    self._fail(attempt, driver.exit_reason() if driver is not None else "its driver was lost")
            except Exception as exc:  # noqa: BLE001 - e.g. a Ray cluster that does not answer: retried by ticks
                log.exception("job %d: cannot check attempt %d", attempt.job_id, attempt.number)
                self.last_error = f"re-attaching job {attempt.job_id}: {type(exc).__name__}: {exc}"
        if self.settings.launcher == "off":
            return  # a server that launches nothing judges no launch
        live_jobs = {a.job_id for a in self.store.attempts(live_only=True)}
        starting, _ = self.store.jobs(status=[JobStatus.STARTING.value], limit=1000, source="api")
        for job in starting:
            if job.id not in live_jobs:  # admission makes the attempt with the status: none means a crash between
                try:
                    self.store.set_status(
                        job.id, JobStatus.FAILED, error="launch interrupted by a restart of the API; resumable"
                    )
                except InvalidTransition:
                    pass

    def _launch_interrupted(self, attempt: Attempt) -> bool:
        """An attempt this server's kind of launcher admitted (on this host, for `local`) that never got its driver:
        the server stopped between the two (a launch that is under way elsewhere gets its driver within seconds)."""
        if attempt.launcher != self.settings.launcher or attempt.driver_pid or attempt.submission_id:
            return False
        if attempt.launcher == "local" and attempt.driver_host != socket.gethostname():
            return False
        started = attempt.started_at if attempt.started_at.tzinfo else attempt.started_at.replace(tzinfo=timezone.utc)
        return time.time() - started.timestamp() > 30

    def _driver_of(self, attempt: Attempt) -> Driver | None:
        """The driver of an attempt this server can see and judge, else None: a `local` attempt of this host when
        this server launches locally, a `ray_job` attempt when it submits to a cluster, a `miles run` of this host."""
        here = attempt.driver_host == socket.gethostname()
        if attempt.launcher == "local" and self.settings.launcher == "local" and attempt.driver_pid and here:
            return LocalDriver(attempt.id, attempt.driver_pid)
        if attempt.launcher == "ray_job" and self.settings.launcher == "ray_job" and attempt.submission_id:
            assert self.settings.ray_address is not None  # the settings require it for ray_job
            return RayJobDriver(attempt.id, self.settings.ray_address, attempt.submission_id)
        if attempt.launcher == "inline" and attempt.driver_host == socket.gethostname() and attempt.driver_pid:
            started = attempt.started_at
            if started.tzinfo is None:  # SQLite keeps no time zone; the store writes UTC
                started = started.replace(tzinfo=timezone.utc)
            return InlineRun(attempt.id, attempt.driver_pid, started.timestamp())
        return None

    def _fail(self, attempt: Attempt, reason: str) -> None:
        self.store.end_attempt(attempt.id, reason)
        job = self.store.job(attempt.job_id)
        if JobStatus(job.status) in FINAL:
            return
        status = JobStatus.CANCELLED if job.cancel_requested else JobStatus.FAILED
        checkpoint = self.store.last_checkpoint(job.id)
        where = f"resume starts after step {checkpoint.step}" if checkpoint else "resume starts from scratch"
        try:
            self.store.set_status(job.id, status, error=f"{reason}; resumable ({where})")
        except InvalidTransition:
            pass  # the driver finished the job just now

    def store_problem(self) -> str:
        """ok, or why this server cannot write its store: the last write failed, or a SQLite store's disk is full."""
        from sqlalchemy.exc import DBAPIError

        if isinstance(self._last_exc, DBAPIError):
            return f"error: cannot write: {' '.join(str(self._last_exc.orig or self._last_exc).split())[:300]}"
        url = self.store.url
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            folder = Path(url.removeprefix("sqlite:///")).resolve().parent
            free = shutil.disk_usage(folder).free if folder.is_dir() else 0
            if free < MIN_FREE_BYTES:
                return f"error: {free} bytes free on the store's disk ({folder}); writes fail"
        return "ok"

    def ray_problem(self) -> str:
        """ok, not started, unchecked (a cluster behind `ray_job`: its jobs report it), or why Ray does not answer."""
        if self.settings.launcher != "local":
            return "unchecked"
        return self.ray.problem()

    def tick(self) -> None:
        for attempt, reason in list(self._failed_launches.values()):  # the store may take the failure now
            self._fail(attempt, reason)
            del self._failed_launches[attempt.id]
        self._reap()
        self._cancel()
        if self.settings.launcher != "off":
            self._launch()

    def _reap(self) -> None:
        for attempt in self.store.attempts(live_only=True):  # `miles run` jobs that started meanwhile
            if attempt.launcher == "inline" and attempt.id not in self.drivers:
                driver = self._driver_of(attempt)
                if driver is not None:
                    self.drivers[attempt.id] = driver
        for attempt_id, driver in list(self.drivers.items()):
            if driver.alive():
                continue
            del self.drivers[attempt_id]
            self._term_sent.pop(attempt_id, None)
            attempt = self.store.attempt(attempt_id)
            if attempt.status != "ended":
                self._fail(attempt, driver.exit_reason())

    def _cancel(self) -> None:
        now = time.time()
        for attempt_id, driver in self.drivers.items():
            attempt = self.store.attempt(attempt_id)
            if not self.store.job(attempt.job_id).cancel_requested:
                continue
            sent = self._term_sent.get(attempt_id)
            if sent is None:
                log.info("job %d: cancelling attempt %d", attempt.job_id, attempt.number)
                driver.terminate()
                self._term_sent[attempt_id] = now
            elif now - sent > self.settings.cancel_grace_s:
                log.warning("job %d: driver still runs %.0fs after the cancel; killing it", attempt.job_id, now - sent)
                driver.kill()

    def _launch(self) -> None:
        queued, _ = self.store.jobs(status=[JobStatus.QUEUED.value], limit=1000, source="api")
        kind = self.settings.launcher
        host = socket.gethostname() if kind == "local" else None  # ray_job: the cluster is one site
        for job in sorted(queued, key=lambda j: j.id):  # first come, first served; no overtaking
            try:  # atomic across every server of the store: the CPU budget is this host's, not this process's
                attempt = self.store.admit(job.id, kind, host, self.settings.cpus, _demand_of)
            except InvalidTransition:
                continue  # cancelled, or taken by another server, meanwhile
            if attempt is None:
                return
            self._start_driver(job.id, attempt)

    def _start_driver(self, job_id: int, attempt: Attempt) -> None:
        kind = self.settings.launcher
        log_path = self.settings.logs_root / f"job-{job_id}" / f"attempt-{attempt.number}.log"
        try:
            if kind == "local":
                address = self.ray.address()
                driver: Driver = LocalDriver.start(
                    driver_store_url(self.store.url), job_id, attempt.id, address, log_path, self.ray.driver_env,
                    engine_log_dir(log_path),
                )  # fmt: skip
                self.store.update_attempt(
                    attempt.id, driver_pid=driver.pid, driver_host=socket.gethostname(), log_path=str(log_path)
                )
            else:
                if not self.settings.ray_address:
                    raise ValueError("launcher ray_job needs ray_address (the cluster's dashboard URL)")
                driver = RayJobDriver.start(self.settings, driver_store_url(self.store.url), job_id, attempt.id)
                self.store.update_attempt(attempt.id, submission_id=driver.submission_id)
        except Exception as exc:
            reason = f"launch failed: {type(exc).__name__}: {exc}"
            try:
                self._fail(attempt, reason)
            except Exception:  # the store cannot take it now (a full disk): the next tick tries again
                self._failed_launches[attempt.id] = (attempt, reason)
            raise
        self.drivers[attempt.id] = driver
        self.store.add_event(
            job_id, "launched", f"attempt {attempt.number} launched ({kind})", data={"log": str(log_path)}
        )
