"""The local Ray head: started on demand by the first job and shared by all of them."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from miles_control.service.launch.processes import forget_ray_cluster, kill_process_group, port_open
from miles_control.service.settings import ServerSettings

log = logging.getLogger(__name__)


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
            if port_open(host, int(port)):
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
            # Token auth, said explicitly, with a token made if this machine has none (~/.ray/auth_token): else the
            # head would start without auth while its drivers (driver_env) ask for it and fail to connect.
            env = {**os.environ, "RAY_AUTH_MODE": "token"}
            subprocess.run([str(ray_bin), "get-auth-token", "--generate"], stdout=subprocess.DEVNULL, stderr=out,
                           env=env, check=False, timeout=60)  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        address = f"127.0.0.1:{port}"
        deadline = time.time() + 120
        while not port_open("127.0.0.1", port):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the local Ray instance did not start: {_tail(log_path)} (log {log_path})")
            time.sleep(0.5)
        time.sleep(1.0)  # a head whose raylet fails exits just after its GCS port opens: fail here, with the cause
        if proc.poll() is not None:
            raise RuntimeError(f"the local Ray instance exited as it started: {_tail(log_path)} (log {log_path})")
        self.state_file.write_text(json.dumps({"address": address, "pgid": proc.pid}))
        return address

    def problem(self) -> str:
        """ok, not started (the first job starts it), or why the Ray instance jobs join does not answer."""
        if self.settings.ray_address:
            host, _, port = self.settings.ray_address.rpartition(":")
            ok = port.isdigit() and port_open(host or "127.0.0.1", int(port))
            return "ok" if ok else f"error: the Ray instance at {self.settings.ray_address} does not answer"
        if not self.state_file.exists():
            return "not started"
        address = json.loads(self.state_file.read_text())["address"]
        host, _, port = address.rpartition(":")
        return "ok" if port_open(host, int(port)) else f"error: the local Ray head at {address} does not answer"

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


def _tail(log_path: Path, lines: int = 5) -> str:
    """The last lines of a log, on one line: an error's cause where a process wrote it."""
    try:
        text = log_path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return "no log"
    return " | ".join(line.strip() for line in text if line.strip()) or "an empty log"
