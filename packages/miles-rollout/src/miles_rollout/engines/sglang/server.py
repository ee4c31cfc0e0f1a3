"""Launch and supervise one SGLang HTTP server process: health-checked start-up, clean shutdown; the tensors of
the checkpoint folder a server starts from (`folder_tensors`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from safetensors.torch import load_file

from miles_rollout.config import SGLangEngineConfig, tp_size
from miles_sync import NamedTensor

SHIM_ENV = "MILES_SGLANG_CPU_SHIM"
PORT_RETRIES = 3  # starts again on a new port when another process took the chosen one first


class EngineStartError(RuntimeError):
    """An SGLang server that could not start; the message names the engine and its log file."""


def cpu_shim_path() -> Path:
    """The folder to put on the server's PYTHONPATH for the CPU-only `sgl_kernel` import shim: shipped with
    this package (`cpu_shim/`, package data), or wherever MILES_SGLANG_CPU_SHIM points."""
    path = Path(os.environ.get(SHIM_ENV) or Path(__file__).with_name("cpu_shim"))
    if not (path / "sgl_kernel" / "__init__.py").is_file():
        raise EngineStartError(
            f"sglang on CPU needs the sgl_kernel import shim: {path}/sgl_kernel/__init__.py is missing "
            f"({SHIM_ENV} overrides where it is looked for)"
        )
    return path


def use_cpu(config: SGLangEngineConfig) -> bool:
    if config.device != "auto":
        return config.device == "cpu"
    import torch

    return not torch.cuda.is_available()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_name(index: int, restart: int = 0) -> str:
    """Server `index`'s log file: `sglang-<i>.log` for its first process, `sglang-<i>.restart-<n>.log` after its n-th
    restart, so a restarted server keeps its predecessor's log (where the crash's cause is)."""
    return f"sglang-{index}.log" if restart == 0 else f"sglang-{index}.restart-{restart}.log"


def tail(path: Path, num_lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def server_command(
    model_path: str | Path,
    config: SGLangEngineConfig,
    dtype: str,
    port: int,
    seed: int,
    gpu_ids: list[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The `sglang.launch_server` command line of one server and the environment variables it adds.

    On CPU: the CPU recipe (torch-native paths, the sgl_kernel shim). With `gpu_ids` (the resource plan's share
    for this server): `CUDA_VISIBLE_DEVICES` set to them and `--base-gpu-id 0`, so the server
    uses exactly those GPUs whatever the parent process sees (their number is --tp-size × --dp-size of
    `extra_args`: the job spec checks it).
    """
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-total-tokens",
        str(config.max_total_tokens),
        "--random-seed",
        str(seed),
        # The warm-up request is English text; it crashes the scheduler for the character tokenizer of
        # the built-in model, and start-up is checked with real requests below anyway.
        "--skip-server-warmup",
    ]
    env: dict[str, str] = {}
    if use_cpu(config):
        # CPU-only recipe (infra/cpu/README.md): torch-native paths and the sgl_kernel import shim.
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        # A parent such as a Ray actor may have pinned OpenMP to one thread; the server gets every core
        # this process may use (all of the machine unless the job pinned the rollout to some).
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cpu_shim_path()), os.environ.get("PYTHONPATH")]))
    elif gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        args += ["--base-gpu-id", "0"]  # --tp-size / --dp-size come from rollout.engine.extra_args
    if config.routed_experts:
        args.append("--enable-return-routed-experts")
    return args + list(config.extra_args), env


class SGLangServer:
    """One `sglang.launch_server` process on loopback, logging to `log_path`."""

    def __init__(
        self,
        model_path: str | Path,
        config: SGLangEngineConfig,
        dtype: str,
        index: int,
        log_dir: Path,
        seed: int = 0,
        gpu_ids: list[str] | None = None,
        restart: int = 0,
    ):
        """`restart`: how many times server `index` was restarted before this process (it names the log file)."""
        self.index = index
        self.log_path = log_dir / log_name(index, restart)
        self.tp_size = tp_size(config.extra_args)
        self.gpu_ids = gpu_ids
        self._command = (model_path, config, dtype, seed + index, gpu_ids)
        log_dir.mkdir(parents=True, exist_ok=True)
        if restart == 0:  # a folder reused by an earlier run: its restart logs would pass for this run's
            for stale in log_dir.glob(f"sglang-{index}.restart-*.log"):
                stale.unlink(missing_ok=True)
        self._spawn()

    def _spawn(self) -> None:
        """Start the server on a port free now. SGLang binds it only after loading the model (tens of seconds
        here), so another process can take it meanwhile: `wait_ready` then starts it again on another."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model_path, config, dtype, seed, gpu_ids = self._command
        args, extra_env = server_command(model_path, config, dtype, self.port, seed, gpu_ids)
        env = {**os.environ, **extra_env}
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _lost_its_port(self) -> bool:
        """The server exited because its port was taken between `free_port` and its bind."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        needle = (
            f"127.0.0.1', {self.port})"  # uvicorn: "... bind on address ('127.0.0.1', PORT): address already in use"
        )
        return any("address already in use" in line and needle in line for line in text.splitlines())

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        port_retries = PORT_RETRIES
        while time.time() < deadline:
            code = self.process.poll()
            if code is not None and port_retries and self._lost_its_port():
                port_retries -= 1
                self.stop()  # what is left of its process group
                self.log_path.replace(self.log_path.with_name(f"{self.log_path.stem}.port-{self.port}.log"))
                self._spawn()
                continue
            if code is not None:
                raise EngineStartError(
                    f"sglang engine {self.index} exited with code {code} during start-up; log {self.log_path}:\n"
                    f"{tail(self.log_path)}"
                )
            try:
                if httpx.get(f"{self.url}/model_info", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise EngineStartError(
            f"sglang engine {self.index} did not answer within {timeout_s:.0f} s; log {self.log_path}:\n"
            f"{tail(self.log_path)}"
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the launcher's process group (server, scheduler, detokenizer), then SIGKILL.

        Also when the launcher itself is already gone (killed with -9): its children may live on.
        """
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            self.process.wait(timeout=10)
            return
        deadline = time.time() + timeout_s
        while time.time() < deadline and _group_alive(self.process.pid):
            self.process.poll()  # reap the leader so it does not keep the group alive as a zombie
            time.sleep(0.1)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)


def folder_tensors(folder: Path) -> list[NamedTensor]:
    """Every tensor of a checkpoint folder's safetensors files."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise EngineStartError(f"sglang engine: no *.safetensors weights in {folder}")
    return [pair for f in files for pair in load_file(str(f)).items()]
