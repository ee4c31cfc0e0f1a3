"""The launcher: starts queued jobs as drivers while their CPUs are free, watches them, cancels them,
and after a restart of the API re-attaches to the drivers that kept running.

Two ways to run a driver: `LocalDriver` (a process of this machine in its own session, so it outlives
the API, joined to the local Ray instance, started on demand) and `RayJobDriver` (Ray's job submission
API of a cluster). Job rows are the truth: the driver moves its job to running and to its end; the
launcher marks a job failed only when its driver is gone without having done so."""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timezone
from pathlib import Path
from typing import Protocol

from miles_control.api.policy import job_demand
from miles_control.api.settings import ServerSettings
from miles_control.config import JobSpec
from miles_control.store import FINAL, Attempt, InvalidTransition, JobStatus, Store

log = logging.getLogger(__name__)


class Driver(Protocol):
    attempt_id: int

    def alive(self) -> bool: ...
    def exit_reason(self) -> str: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def driver_store_url(url: str) -> str:
    """The store URL as a driver elsewhere must see it: a relative SQLite path made absolute."""
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/") and url != prefix + ":memory:":
        return prefix + str(Path(url.removeprefix(prefix)).resolve())
    return url


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def _process_start(pid: int) -> float | None:
    """When a process started (unix seconds), from /proc; None if it does not exist."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    except (OSError, StopIteration):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in ticks


def kill_process_group(pgid: int, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s` (Ray's gcs_server ignores SIGTERM for a long while)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        time.sleep(grace_s)


def forget_ray_cluster(address: str) -> None:
    """`ray start` names its head in /tmp/ray/ray_current_cluster; once it is gone, later Ray clients
    must not try to join it (`ray stop` removes the file too)."""
    current = Path("/tmp/ray/ray_current_cluster")
    try:
        if current.read_text().strip().rpartition(":")[2] == address.rpartition(":")[2]:
            current.unlink()
    except OSError:
        pass


class LocalRay:
    """A Ray head on this machine, started on demand by the first job and shared by all of them.

    Its address and process group are kept in `<data_dir>/ray.json` so that a restarted API finds it."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.state_file = settings.data_dir.resolve() / "ray.json"

    def address(self) -> str:
        if self.settings.ray_address:
            return self.settings.ray_address
        if self.state_file.exists():
            state = json.loads(self.state_file.read_text())
            host, _, port = state["address"].rpartition(":")
            if _port_open(host, int(port)):
                return state["address"]
        return self._start()

    def _start(self) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log_path = self.settings.logs_root / "ray-head.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [
            str(ray_bin), "start", "--head", "--block", f"--port={port}",
            f"--num-cpus={max(1, round(self.settings.cpus))}", "--include-dashboard=false", "--disable-usage-stats",
        ]  # fmt: skip
        log.info("starting the local Ray instance on 127.0.0.1:%d (log %s)", port, log_path)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        address = f"127.0.0.1:{port}"
        deadline = time.time() + 120
        while not _port_open("127.0.0.1", port):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the local Ray instance did not start; see {log_path}")
            time.sleep(0.5)
        self.state_file.write_text(json.dumps({"address": address, "pgid": proc.pid}))
        return address

    @property
    def driver_env(self) -> dict[str, str]:
        # `ray start --head` turns on token auth (token in ~/.ray/auth_token); its clients must say so.
        return {} if self.settings.ray_address else {"RAY_AUTH_MODE": "token"}

    def stop(self) -> None:
        """Stop the instance this server started (its whole process group; gcs_server ignores SIGTERM)."""
        if self.settings.ray_address or not self.state_file.exists():
            return
        state = json.loads(self.state_file.read_text())
        kill_process_group(state["pgid"])
        forget_ray_cluster(state["address"])
        self.state_file.unlink(missing_ok=True)


class LocalDriver:
    """`python -m miles_control.driver` as a process of this machine."""

    def __init__(self, attempt_id: int, pid: int, proc: subprocess.Popen | None = None) -> None:
        self.attempt_id, self.pid, self.proc = attempt_id, pid, proc

    @classmethod
    def start(
        cls, store_url: str, job_id: int, attempt_id: int, ray_address: str, log_path: Path, env: dict[str, str]
    ) -> LocalDriver:
        cmd = [
            sys.executable, "-m", "miles_control.driver", "--job-id", str(job_id), "--attempt-id", str(attempt_id),
            "--store", store_url, "--ray-address", ray_address,
        ]  # fmt: skip
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **env}
            )
        return cls(attempt_id, proc.pid, proc)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        # A driver re-attached after a restart is not our child: its pid may have been reused since, so
        # check that the process is that driver (its exact --attempt-id).
        args = _cmdline(self.pid)
        return "miles_control.driver" in args and _arg(args, "--attempt-id") == str(self.attempt_id)

    def exit_reason(self) -> str:
        if self.proc is not None and self.proc.returncode is not None:
            code = self.proc.returncode
            return f"driver exited with code {code}" if code >= 0 else f"driver killed by signal {-code}"
        return "driver process is gone (it ended while the API was down)"

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # the driver leads its own session: reach its children too
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        try:  # the driver stops before its next step (SIGTERM belongs to Ray's handler in a driver)
            os.kill(self.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


class RayJobDriver:
    """A driver submitted to a Ray cluster through its job submission API."""

    def __init__(self, attempt_id: int, address: str, submission_id: str) -> None:
        from ray.job_submission import JobSubmissionClient

        self.attempt_id, self.submission_id = attempt_id, submission_id
        self.client = JobSubmissionClient(address)

    @classmethod
    def start(cls, settings: ServerSettings, store_url: str, job_id: int, attempt_id: int) -> RayJobDriver:
        from ray.job_submission import JobSubmissionClient

        submission_id = f"miles-job-{job_id}-attempt-{attempt_id}-{int(time.time())}"
        entrypoint = shlex.join(
            [settings.driver_python, "-m", "miles_control.driver", "--job-id", str(job_id),
             "--attempt-id", str(attempt_id), "--store", store_url, "--ray-address", "auto"]
        )  # fmt: skip
        env = {k: os.environ[k] for k in ("MILES_CACHE", "RAY_AUTH_MODE") if k in os.environ}
        JobSubmissionClient(settings.ray_address).submit_job(
            entrypoint=entrypoint, submission_id=submission_id, runtime_env={"env_vars": env}
        )
        return cls(attempt_id, settings.ray_address, submission_id)

    def logs(self) -> str:
        return self.client.get_job_logs(self.submission_id)

    def _status(self) -> str:
        return str(self.client.get_job_status(self.submission_id).value)

    def alive(self) -> bool:
        return self._status() in ("PENDING", "RUNNING")

    def exit_reason(self) -> str:
        info = self.client.get_job_info(self.submission_id)
        return f"Ray job {self.submission_id} {info.status.value}: {info.message or ''}".strip()

    def terminate(self) -> None:
        """Nothing to send: the driver sees its job's cancel flag before its next step."""

    def kill(self) -> None:
        self.client.stop_job(self.submission_id)


class Launcher:
    """One thread in the API process; every `poll_interval_s` it reaps, cancels and launches."""

    def __init__(self, store: Store, settings: ServerSettings) -> None:
        self.store, self.settings = store, settings
        self.ray = LocalRay(settings)
        self.drivers: dict[int, Driver] = {}  # attempt id → driver
        self._term_sent: dict[int, float] = {}  # attempt id → when the cancel was sent
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="miles-launcher", daemon=True)
        self.last_error: str | None = None

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
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - keep launching; the error is visible on /health
                log.exception("launcher tick failed")
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(self.settings.poll_interval_s)

    # --- the work -------------------------------------------------------------------------------
    def reattach(self) -> None:
        """After a restart: keep watching drivers that still run; fail the jobs of drivers that are gone,
        and of launches the restart interrupted (a job `starting` with no attempt)."""
        for attempt in self.store.attempts(live_only=True):
            try:
                driver = self._driver_of(attempt)
                if driver is None and attempt.launcher == "inline":
                    continue  # a `miles run` on another machine: not ours to judge
                if driver is not None and driver.alive():
                    self.drivers[attempt.id] = driver
                    self.store.add_event(attempt.job_id, "reattached", f"attempt {attempt.number}: driver re-attached")
                    log.info("job %d: re-attached to attempt %d", attempt.job_id, attempt.number)
                else:
                    self._fail(attempt, driver.exit_reason() if driver is not None else "its driver was lost")
            except Exception as exc:  # noqa: BLE001 - e.g. a Ray cluster that does not answer: retried by ticks
                log.exception("job %d: cannot check attempt %d", attempt.job_id, attempt.number)
                self.last_error = f"re-attaching job {attempt.job_id}: {type(exc).__name__}: {exc}"
        live_jobs = {a.job_id for a in self.store.attempts(live_only=True)}
        starting, _ = self.store.jobs(status=[JobStatus.STARTING.value], limit=1000, source="api")
        for job in starting:
            if job.id not in live_jobs:
                try:
                    self.store.set_status(
                        job.id, JobStatus.FAILED, error="launch interrupted by a restart of the API; resumable"
                    )
                except InvalidTransition:
                    pass

    def _driver_of(self, attempt: Attempt) -> Driver | None:
        if attempt.launcher == "local" and attempt.driver_pid and attempt.driver_host == socket.gethostname():
            return LocalDriver(attempt.id, attempt.driver_pid)
        if attempt.launcher == "ray_job" and attempt.submission_id and self.settings.ray_address:
            return RayJobDriver(attempt.id, self.settings.ray_address, attempt.submission_id)
        if attempt.launcher == "inline" and attempt.driver_host == socket.gethostname() and attempt.driver_pid:
            started = attempt.started_at
            if started.tzinfo is None:  # SQLite keeps no time zone; the store writes UTC
                started = started.replace(tzinfo=timezone.utc)
            return _InlineRun(attempt.id, attempt.driver_pid, started.timestamp())
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

    def tick(self) -> None:
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

    def used_cpus(self) -> float:
        used = 0.0
        for attempt in self.store.attempts(live_only=True):
            used += job_demand(JobSpec.model_validate(self.store.job(attempt.job_id).spec))
        return used

    def _launch(self) -> None:
        queued, _ = self.store.jobs(status=[JobStatus.QUEUED.value], limit=1000, source="api")
        if not queued:
            return
        used = self.used_cpus()
        for job in sorted(queued, key=lambda j: j.id):  # first come, first served; no overtaking
            demand = job_demand(JobSpec.model_validate(job.spec))
            if used + demand > self.settings.cpus + 1e-9:
                return
            try:
                self.store.set_status(job.id, JobStatus.STARTING, expect=JobStatus.QUEUED)
            except InvalidTransition:
                continue  # cancelled meanwhile
            self._start_driver(job.id)
            used += demand

    def _start_driver(self, job_id: int) -> None:
        kind = self.settings.launcher
        attempt = self.store.start_attempt(job_id, kind)
        log_path = self.settings.logs_root / f"job-{job_id}" / f"attempt-{attempt.number}.log"
        try:
            if kind == "local":
                address = self.ray.address()
                driver: Driver = LocalDriver.start(
                    driver_store_url(self.store.url), job_id, attempt.id, address, log_path, self.ray.driver_env
                )
                self.store.update_attempt(
                    attempt.id, driver_pid=driver.pid, driver_host=socket.gethostname(), log_path=str(log_path)
                )
            else:
                if not self.settings.ray_address:
                    raise ValueError("launcher ray_job needs ray_address (the cluster's dashboard URL)")
                driver = RayJobDriver.start(self.settings, driver_store_url(self.store.url), job_id, attempt.id)
                self.store.update_attempt(attempt.id, submission_id=driver.submission_id)
        except Exception as exc:
            self._fail(attempt, f"launch failed: {type(exc).__name__}: {exc}")
            raise
        self.drivers[attempt.id] = driver
        self.store.add_event(
            job_id, "launched", f"attempt {attempt.number} launched ({kind})", data={"log": str(log_path)}
        )


class _InlineRun(LocalDriver):
    """A `miles run` in some terminal of this machine: watched for liveness only (the API did not start it).

    Its process started before it made its attempt row; a process with its pid that started later is
    another one (a reused pid)."""

    def __init__(self, attempt_id: int, pid: int, attempt_started: float) -> None:
        super().__init__(attempt_id, pid)
        self.attempt_started = attempt_started

    def alive(self) -> bool:
        started = _process_start(self.pid)
        return started is not None and started <= self.attempt_started + 2.0

    def terminate(self) -> None:
        try:
            os.kill(self.pid, signal.SIGINT)  # what Ctrl-C does: the run ends `cancelled`
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
