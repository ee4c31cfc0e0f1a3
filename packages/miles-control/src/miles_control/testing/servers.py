"""Helpers for tests and benchmarks of the control plane: a throw-away PostgreSQL database and an API
server process on loopback. Used by the test suites and `bench/api_latency.py`; not needed at run time."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from sqlalchemy.engine import make_url

PG_ENV = "MILES_TEST_PG_URL"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def fresh_pg_database(base_url: str) -> Iterator[str]:
    """A new, empty database next to `base_url`'s (its role needs CREATEDB); dropped afterwards."""
    import psycopg

    url = make_url(base_url)
    name = f"miles_t_{uuid.uuid4().hex[:12]}"
    admin = dict(host=url.host, port=url.port or 5432, user=url.username, password=url.password, dbname=url.database)
    with psycopg.connect(**admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(**admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class ApiServer:
    """`miles serve` as a process of its own (so it can be killed with -9 and started again)."""

    def __init__(
        self,
        store_url: str,
        data_dir: Path,
        env: dict[str, str] | None = None,
        wrapper: list[str] | None = None,
        **settings: str,
    ) -> None:
        """`wrapper`: a command the server runs under (e.g. `unshare --uts …`, another host's name)."""
        self.store_url, self.data_dir, self.settings = store_url, Path(data_dir), settings
        self.env, self.wrapper = env or {}, wrapper or []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = self.data_dir / "serve.log"

    def start(self, timeout: float = 60.0) -> ApiServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "MILES_STORE_URL": self.store_url,
            "MILES_DATA_DIR": str(self.data_dir / "state"),
            **{f"MILES_{k.upper()}": v for k, v in self.settings.items()},
            **self.env,
        }
        cmd = [*self.wrapper, sys.executable, "-m", "miles_control.cli.main", "serve", "--port", str(self.port)]
        cmd += ["--log-level", "warning"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.data_dir)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"miles serve exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"miles serve did not answer in {timeout}s: {self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_until_serving(url: str, proc: subprocess.Popen, timeout: float = 60.0, log: Path | None = None) -> None:
    """Wait until `url` answers 200 while `proc` (the process that will serve it) runs."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise RuntimeError(
                f"{url} did not answer (process {'exited' if proc.poll() is not None else 'running'}){tail}"
            )
        time.sleep(0.5)


def stop_local_ray(data_dir: Path) -> None:
    """Stop a local Ray instance an API server under `data_dir` started and left behind (after kill -9)."""
    import json

    from miles_control.service.launch import forget_ray_cluster

    state = Path(data_dir) / "state" / "ray.json"
    if state.exists():
        info = json.loads(state.read_text())
        try:
            os.killpg(info["pgid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        forget_ray_cluster(info["address"])
        state.unlink()


@contextmanager
def ray_cluster_with_dashboard(workdir: Path, num_cpus: int = 2) -> Iterator[str]:
    """A Ray head with its dashboard (the job submission API) on this machine; yields the dashboard URL.

    Needs `ray[default]`. Token auth is on (Ray's default): clients need RAY_AUTH_MODE=token."""
    port, dashboard_port = free_port(), free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "ray-cluster.log"
    cmd = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        f"--num-cpus={num_cpus}", "--disable-usage-stats",
    ]  # fmt: skip
    with open(log, "ab") as out:
        env = {**os.environ, "RAY_AUTH_MODE": "token"}  # on, with a token made where this machine has none
        subprocess.run([cmd[0], "get-auth-token", "--generate"], stdout=subprocess.DEVNULL, env=env, check=False)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the Ray head did not start: {log.read_text()[-3000:]}")
            try:
                httpx.get(f"{url}/api/version", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url
    finally:
        from miles_control.service.launch import forget_ray_cluster, kill_process_group

        kill_process_group(proc.pid)
        forget_ray_cluster(f"127.0.0.1:{port}")


def requirement_closure(names: list[str]) -> set[str]:
    """The distributions `names` require, transitively (no extras), by this environment's installed metadata:
    what a fresh environment holding only them would need."""
    import re
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.distribution(name).requires or []:
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def link_distributions(names: set[str], site: Path) -> None:
    """Symlink every top-level entry (packages, modules, .dist-info) of each installed distribution into `site`,
    the site-packages of a fresh venv: a venv of exactly those distributions without copying gigabytes."""
    from importlib import metadata

    for name in names:
        dist = metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        for entry in {Path(str(f)).parts[0] for f in dist.files or []}:
            source, target = base / entry, site / entry
            if source.exists() and not target.exists() and not entry.startswith(".."):
                target.symlink_to(source)


def fresh_venv(folder: Path, with_pip: bool) -> tuple[Path, Path]:
    """A new venv in `folder` (with pip only when asked: ensurepip costs seconds): its python and its
    site-packages folder."""
    args = [sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(folder)]
    subprocess.run(args, check=True)
    python = folder / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(python), "-c", purelib], check=True, capture_output=True, text=True).stdout.strip()
    return python, Path(site)


def put_in_hub_cache(cache: Path, repo_id: str, files: Path, repo_type: str = "model", revision: str = "main") -> Path:
    """Lay the files of folder `files` out in a Hugging Face cache (`HF_HUB_CACHE`) as `huggingface_hub` leaves a
    downloaded repository: `<type>s--<org>--<name>/snapshots/<commit>/…` and `refs/<revision>` naming the commit.
    With `HF_HUB_OFFLINE=1`, `snapshot_download(repo_id)` then resolves to that snapshot (what a machine without
    network sees after a download elsewhere). Returns the snapshot folder."""
    import hashlib

    repo = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
