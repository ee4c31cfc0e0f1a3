"""Drivers: how the launcher runs `python -m miles_control.service.driver` for a job attempt and watches it.

`LocalDriver` is a process of this machine in its own session (it outlives the API); `RayJobDriver` is a
Ray job submitted to a cluster; `InlineRun` is a `miles run` started in some terminal, which the launcher
only watches."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from miles_control.job.redact import mask_credentials
from miles_control.service.driver import STORE_URL_ENV
from miles_control.service.launch.processes import arg_after, cmdline, process_start
from miles_control.service.settings import ServerSettings

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient


class Driver(Protocol):
    attempt_id: int

    def alive(self) -> bool: ...
    def exit_reason(self) -> str: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def engine_log_dir(log_path: Path) -> Path:
    """Where an attempt's SGLang servers log (`sglang-<i>.log`) when its spec names no rollout.engine.log_dir: beside
    the driver's log, `attempt-<n>-engines/`."""
    return log_path.with_name(f"{log_path.stem}-engines")


def driver_command(python: str, job_id: int, attempt_id: int, ray_address: str) -> list[str]:
    """The driver's command line: no store URL (see STORE_URL_ENV). `--attempt-id` stays on it: a re-attached
    launcher recognises its drivers by it in /proc (`LocalDriver.alive`)."""
    return [
        python, "-m", "miles_control.service.driver", "--job-id", str(job_id), "--attempt-id", str(attempt_id),
        "--ray-address", ray_address,
    ]  # fmt: skip


def driver_store_url(url: str) -> str:
    """The store URL as a driver elsewhere must see it: a relative SQLite path made absolute."""
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url.startswith(prefix + "/") and url != prefix + ":memory:":
        return prefix + str(Path(url.removeprefix(prefix)).resolve())
    return url


class LocalDriver:
    """`python -m miles_control.service.driver` as a process of this machine."""

    def __init__(self, attempt_id: int, pid: int, proc: subprocess.Popen | None = None) -> None:
        self.attempt_id, self.pid, self.proc = attempt_id, pid, proc

    @classmethod
    def start(
        cls,
        store_url: str,
        job_id: int,
        attempt_id: int,
        ray_address: str,
        log_path: Path,
        env: dict[str, str],
        engine_logs: Path | None = None,
    ) -> LocalDriver:
        """Start the driver in a session of its own, logging to `log_path`; `store_url` travels in its environment."""
        cmd = driver_command(sys.executable, job_id, attempt_id, ray_address)
        if engine_logs is not None:
            cmd += ["--engine-log-dir", str(engine_logs)]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **env, STORE_URL_ENV: store_url},
            )
        return cls(attempt_id, proc.pid, proc)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        # A driver re-attached after a restart is not our child: its pid may have been reused since, so
        # check that the process is that driver (its exact --attempt-id).
        args = cmdline(self.pid)
        return "miles_control.service.driver" in args and arg_after(args, "--attempt-id") == str(self.attempt_id)

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
        self.attempt_id, self.submission_id = attempt_id, submission_id
        self.client = _submission_client(address)

    @classmethod
    def start(cls, settings: ServerSettings, store_url: str, job_id: int, attempt_id: int) -> RayJobDriver:
        assert settings.ray_address is not None  # the launcher checks it first
        submission_id = f"miles-job-{job_id}-attempt-{attempt_id}-{int(time.time())}"
        entrypoint, runtime_env = ray_job_submission(settings, store_url, job_id, attempt_id)
        try:
            _submission_client(settings.ray_address).submit_job(
                entrypoint=entrypoint, submission_id=submission_id, runtime_env=runtime_env
            )
        except Exception as exc:  # noqa: BLE001 - the launcher shows it (an event, /health): without the password
            raise RuntimeError(mask_credentials(f"{type(exc).__name__}: {exc}")) from None
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


def ray_job_submission(
    settings: ServerSettings, store_url: str, job_id: int, attempt_id: int
) -> tuple[str, dict[str, dict[str, str]]]:
    """The entrypoint and runtime_env of a driver's Ray job. The store URL is one of the job's environment
    variables, not part of the entrypoint (which Ray shows in its job list and logs). Ray still shows a job's
    runtime_env, its variables included, to whoever can reach the cluster's dashboard: keep that port as closed as
    the database itself (the driver runs on the cluster, so a file on this server cannot carry it there)."""
    entrypoint = shlex.join(driver_command(settings.driver_python, job_id, attempt_id, "auto"))
    env = {k: os.environ[k] for k in ("MILES_CACHE", "RAY_AUTH_MODE") if k in os.environ}
    return entrypoint, {"env_vars": {**env, STORE_URL_ENV: store_url}}


def _submission_client(address: str) -> JobSubmissionClient:
    """A client of the cluster's job API; an address it cannot reach is an error without its password."""
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # noqa: BLE001 - any of them may quote the address
        raise RuntimeError(mask_credentials(f"{type(exc).__name__}: {exc}")) from None


class InlineRun(LocalDriver):
    """A `miles run` in some terminal of this machine: watched for liveness only (the API did not start it).

    Its process started before it made its attempt row; a process with its pid that started later is
    another one (a reused pid)."""

    def __init__(self, attempt_id: int, pid: int, attempt_started: float) -> None:
        super().__init__(attempt_id, pid)
        self.attempt_started = attempt_started

    def alive(self) -> bool:
        started = process_start(self.pid)
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
