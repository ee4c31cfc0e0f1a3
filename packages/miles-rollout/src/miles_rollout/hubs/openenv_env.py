"""`rollout.environment: {type: openenv, app | url, ...}`: an OpenEnv environment server's sessions as episodes.

OpenEnv (Meta, PyPI `openenv`) serves an environment over HTTP and a WebSocket: `create_app(env_factory,
ActionCls, ObservationCls)` makes a FastAPI app, and each WebSocket session holds one environment (`reset`, `step`,
`close`), answered with an observation, a reward and `done`. Miles starts the server as a local process
(`app: module:attribute`, run with uvicorn on a free loopback port, one server per rollout process) or attaches to
one (`url`), and talks to it with OpenEnv's own client (`GenericEnvClient`, plain dictionaries: nothing of the
environment's package is needed in the rollout process). Each episode of Miles' runner (`rollout.generate:
multi_turn`) is one session:

- reset: with `reset_args` and a seed from the prompt record (so a group's episodes start alike); the first
  observation (its `observation_field`, or its fields as JSON) is the prompt; an empty one leaves the prompt record's
  prompt as it is.
- each model turn is an action: `{action_field: the turn's text, **action_args}`; the answer's observation is the
  next user turn, its reward adds to the episode's (`rollout.reward: env`), `done` ends the episode.

At most `max_sessions` sessions are open at once per server (OpenEnv refuses more than its `max_concurrent_envs`,
1 by default): an episode waits for a free one before it starts. A server Miles started that died is started again
before the next session. An episode whose reset fails retries (`retries` times) after the server is checked: one
that died or fails its health check is started again, a healthy one is left alone (the failure was the session's).
An episode whose server dies mid-episode ends with `env_error` and
the reason, counted in `rollout/end_env_error` (`rollout.multi_turn.env_failures: drop` leaves it out of
training); the job goes on.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from miles_rollout.config import OpenEnvEnvironment
from miles_rollout.env import Action, StepResult
from miles_rollout.plugin_check import plugin_dirs_on_path

INSTALL = "pip install 'miles-rollout[hubs]' (openenv==0.10.0)"


def _client_class() -> Any:
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as exc:
        raise ValueError(f"rollout.environment: type openenv needs PyPI openenv: {INSTALL} ({exc})") from None
    return GenericEnvClient


class Server:
    """An OpenEnv server Miles runs: `python -m uvicorn APP` on a free loopback port, started on first use and again
    whenever it has died; its output goes to a log file beside the job's other logs (MILES_LOG_DIR, else /tmp)."""

    def __init__(self, app: str, start_timeout_s: float) -> None:
        self.app, self.start_timeout_s = app, start_timeout_s
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0
        self._log: Any = None
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self) -> bool:
        import httpx

        try:
            return self.alive() and httpx.get(self.url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def ensure(self) -> str:
        """The URL of a running server (started now when it is not)."""
        with self._lock:
            if not self.alive():
                self._start()
            return self.url

    def recover(self) -> None:
        """After a failed reset: a server that died, or no longer answers its health check, is started again; a
        healthy one (the failure was the session's, not the server's) is left alone for the other episodes."""
        with self._lock:
            if not self.healthy():
                self._start()

    def _start(self) -> None:
        self._stop()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        plugin_dirs_on_path()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the job's plugin folders included
        log_dir = Path(os.environ.get("MILES_LOG_DIR", "/tmp"))
        log_dir.mkdir(parents=True, exist_ok=True)
        log = open(log_dir / f"openenv-{os.getpid()}-{port}.log", "ab")  # noqa: SIM115 - the server's, kept open
        self._log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", self.app, "--host", "127.0.0.1", "--port", str(port), "--log-level",
             "warning"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        self.starts += 1
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_timeout_s
        import httpx

        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"rollout.environment.app: the OpenEnv server {self.app!r} exited with {self.process.returncode} "
                    f"at start (its log: {log.name})"
                )
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self._stop()
        raise RuntimeError(
            f"rollout.environment.start_timeout_s: the OpenEnv server {self.app!r} did not answer in "
            f"{self.start_timeout_s} s (its log: {log.name})"
        )

    def stop(self) -> None:
        """Stop the server (its whole process group: uvicorn and anything it started)."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.wait(timeout=10)
        self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None


_SERVERS: dict[str, Server] = {}
_SERVERS_LOCK = threading.Lock()
_SLOTS: dict[str, threading.BoundedSemaphore] = {}


def stop_servers() -> None:
    """Stop every server this process started (the rollout worker's shutdown, and at exit)."""
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
    for server in servers:
        server.stop()


atexit.register(stop_servers)


def _slots(spec: OpenEnvEnvironment) -> threading.BoundedSemaphore:
    key = spec.app or spec.url or ""
    with _SERVERS_LOCK:
        if key not in _SLOTS:
            _SLOTS[key] = threading.BoundedSemaphore(spec.max_sessions)
        return _SLOTS[key]


def server_of(spec: OpenEnvEnvironment) -> Server:
    """This process's server of `spec.app` (one per app)."""
    assert spec.app is not None
    with _SERVERS_LOCK:
        if spec.app not in _SERVERS:
            _SERVERS[spec.app] = Server(spec.app, spec.start_timeout_s)
        return _SERVERS[spec.app]


def observation_text(observation: Any, field: str | None) -> str:
    """What the model reads of an observation: its `field`, else its own fields as JSON."""
    if not isinstance(observation, dict):
        return "" if observation is None else str(observation)
    if field is not None:
        if field not in observation:
            raise ValueError(
                f"rollout.environment.observation_field: the observation has no {field!r} (it has {sorted(observation)})"
            )
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
    rest = {k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")}
    return json.dumps(rest) if rest else ""


class Session:
    """One episode's OpenEnv session: Miles' environment protocol (reset, step, close) over OpenEnv's client."""

    def __init__(self, spec: OpenEnvEnvironment) -> None:
        self.spec = spec
        self.client: Any = None
        # one of the server's max_sessions, held until close(): waited for here, on the episode's own thread
        self._slot: threading.BoundedSemaphore | None = _slots(spec)
        self._slot.acquire()

    def _connect(self) -> Any:
        url = server_of(self.spec).ensure() if self.spec.app is not None else self.spec.url
        client = _client_class()(base_url=url, connect_timeout_s=10.0, message_timeout_s=60.0).sync()
        client.connect()
        return client

    def reset(self, record: Any) -> str | None:
        attempts = self.spec.retries + 1 if self.spec.app is not None else 1
        for attempt in range(attempts):
            try:
                self.client = self._connect()
                result = self.client.reset(**self._reset_args(record))
                break
            except Exception:
                self._disconnect()
                if attempt == attempts - 1:
                    raise
                server_of(self.spec).recover()
        text = observation_text(result.observation, self.spec.observation_field)
        return text or None

    def _reset_args(self, record: Any) -> dict[str, Any]:
        """`reset_args`, and a seed from the prompt record (unless they give one): the episodes of a group share
        their prompt, so they start from the same state, as GRPO's group baseline needs."""
        args = dict(self.spec.reset_args)
        if record is not None and "seed" not in args:
            args["seed"] = zlib.crc32(record.prompt.encode())
        return args

    def step(self, action: Action) -> StepResult:
        result = self.client.step({self.spec.action_field: action.text, **self.spec.action_args})
        reward = 0.0 if result.reward is None else float(result.reward)
        text = observation_text(result.observation, self.spec.observation_field)
        return StepResult(observation=text or None, reward=reward, done=bool(result.done))

    def _disconnect(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            try:
                client.close()
            except Exception:  # noqa: BLE001 - a session on a dead server: nothing to close
                pass

    def close(self) -> None:
        """End the session and give its slot back."""
        self._disconnect()
        if self._slot is not None:
            slot, self._slot = self._slot, None
            slot.release()


def session_factory(spec: OpenEnvEnvironment):
    """One session per call: what `GenerateContext.new_environment` makes for each episode."""
    _client_class()  # the package is there (ValueError naming the field, before any episode)
    return lambda: Session(spec)
