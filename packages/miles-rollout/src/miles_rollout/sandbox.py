"""Run model-written Python in a sandbox: bubblewrap (Debian's `bubblewrap`) for the isolation, kernel limits for
the resources, a bounded pool of workers for throughput.

What one execution gets (`tool: bwrap`):
- its own namespaces (`--unshare-all`): no network (only a loopback that leads nowhere), its own process tree (the
  host's processes, the rollout actor included, cannot be seen or signalled; the program is its tree's first
  process, so that nothing of it is left to reap once it ends: bubblewrap's own init would be orphaned, and a
  container whose first process reaps no orphans keeps them as zombies), its own hostname and IPC;
- a filesystem of `/usr` read-only (the system interpreter and its standard library) and an empty, size-limited
  `/tmp` of its own as the working folder; nothing else of the host exists in it (no `/root`, `/home`, `/etc`,
  the job's store, tokens or caches), and the environment is cleared (no secrets in variables);
- a user of its own outside the sandbox (a uid per worker when Miles runs as root), so that a limit of processes
  counts only its own;
- limits: CPU seconds, wall seconds, address space, processes, size of a written file, open files, and the bytes
  of output read back (the process is killed past it).

`tool: none` runs the same command with the same limits but without bubblewrap's isolation; it exists for machines
where bubblewrap cannot create namespaces, and the docs say so. Every execution ends in one `Outcome`.
"""

from __future__ import annotations

import enum
import os
import resource
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

SANDBOX_UID_BASE = 61000  # uids of the workers' executions when Miles runs as root (one per worker)


class Outcome(str, enum.Enum):
    """How one execution ended."""

    PASSED = "passed"  # exit 0 and, with an expected output, that output
    FAILED = "failed"  # ran to its end: a nonzero exit (an assertion, an exception) or another output
    TIMEOUT = "timeout"  # past its CPU or wall seconds
    MEMORY = "memory"  # past its address space
    CRASHED = "crashed"  # killed by a signal of its own doing (a segfault, an abort)
    OUTPUT_LIMIT = "output_limit"  # wrote more than output_bytes
    SANDBOX_ERROR = "sandbox_error"  # the sandbox itself could not run it


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    processes: int = 16
    output_bytes: int = 64 * 1024
    file_mb: int = 16
    open_files: int = 64


@dataclass
class Execution:
    outcome: Outcome
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    reason: str = ""


class SandboxError(RuntimeError):
    """The sandbox cannot run here (a missing tool or interpreter): raised before any execution is tried."""


class Sandbox:
    """Runs Python sources; `workers` executions at once, at most `queue` waiting (submit blocks past it)."""

    def __init__(
        self,
        tool: Literal["bwrap", "none"] = "bwrap",
        limits: Limits | None = None,
        python: str = "/usr/bin/python3",
        workers: int = 2,
        queue: int = 64,
    ) -> None:
        self.tool, self.limits, self.python, self.workers = tool, limits or Limits(), python, workers
        check_sandbox(tool, python)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
        self._room = threading.BoundedSemaphore(workers + queue)
        self._slots = list(range(workers))
        self._slots_lock = threading.Lock()

    def submit(self, source: str, stdin: str = "", expected_stdout: str | None = None) -> Future[Execution]:
        """Queue one execution (blocks while the queue is full)."""
        self._room.acquire()
        future = self._pool.submit(self._in_slot, source, stdin, expected_stdout)
        future.add_done_callback(lambda _: self._room.release())
        return future

    def run(self, source: str, stdin: str = "", expected_stdout: str | None = None) -> Execution:
        return self.submit(source, stdin, expected_stdout).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _in_slot(self, source: str, stdin: str, expected: str | None) -> Execution:
        with self._slots_lock:
            slot = self._slots.pop()
        try:
            result = execute(source, stdin, expected, self.tool, self.limits, self.python, slot)
            if os.getuid() == 0 and result.outcome is not Outcome.PASSED:
                _wait_gone(SANDBOX_UID_BASE + slot)  # a killed execution's processes die with its namespace, soon
            return result
        finally:
            with self._slots_lock:
                self._slots.append(slot)


def check_sandbox(tool: str, python: str) -> None:
    """Refuse before any execution: bubblewrap missing or unable to create its namespaces, or no interpreter."""
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        raise SandboxError(f"python: {python!r} is not an executable absolute path")
    if tool == "none":
        return
    if tool != "bwrap":
        raise SandboxError(f"tool: {tool!r} is not bwrap or none")
    if shutil.which("bwrap") is None:
        raise SandboxError("tool: bwrap is not installed (Debian: apt-get install bubblewrap)")
    if not python.startswith("/usr/"):
        raise SandboxError(f"python: {python!r} is outside /usr, the only host folder the sandbox mounts")
    probe = execute("print('ok')", "", "ok", tool, Limits(), python, 0)
    if probe.outcome is not Outcome.PASSED:
        raise SandboxError(f"tool: bwrap cannot run here ({probe.reason or probe.stderr.strip()[:200]})")


def _command(tool: str, python: str, limits: Limits) -> list[str]:
    run = [python, "-I", "-S", "-c", "import sys; exec(compile(sys.stdin.buffer.read(int(sys.argv[1])), 'solution.py', 'exec'))"]  # fmt: skip
    if tool == "none":
        return run
    return [
        "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev", "--as-pid-1",
        "--size", str(limits.file_mb * 1024 * 1024), "--tmpfs", "/tmp", "--chdir", "/tmp",
        "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
        "--hostname", "sandbox", *run,
    ]  # fmt: skip


def _processes_of(uid: int) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += 1
        except OSError:
            pass
    return count


def _wait_gone(uid: int, timeout_s: float = 10.0) -> None:
    """Until no process of `uid` is left (the slot's next execution must not find its process limit used up)."""
    deadline = time.monotonic() + timeout_s
    while _processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _limit(limits: Limits, slot: int):
    """What runs in the child before bubblewrap: a session of its own (killed as a group), the limits, and, when
    Miles runs as root, a uid of its own (a process limit counts that uid's processes only)."""
    own = 0 if os.getuid() == 0 else _processes_of(os.getuid())

    def apply() -> None:
        os.setsid()
        mb = 1024 * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.getuid() == 0:
            uid = SANDBOX_UID_BASE + slot
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        else:  # the limit counts every process of this user: its own count now, and the execution's on top
            resource.setrlimit(resource.RLIMIT_NPROC, (own + limits.processes, own + limits.processes))

    return apply


def execute(
    source: str, stdin: str, expected: str | None, tool: str, limits: Limits, python: str, slot: int = 0
) -> Execution:
    """One execution, start to end; never raises for what the program does."""
    code = source.encode()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [*_command(tool, python, limits), str(len(code))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_limit(limits, slot), close_fds=True, env={"PATH": "/usr/bin:/bin"}, cwd="/",
        )  # fmt: skip
    except OSError as exc:
        return Execution(Outcome.SANDBOX_ERROR, None, "", "", 0.0, f"cannot start: {exc}")
    out, err, over = bytearray(), bytearray(), threading.Event()

    def read(stream, into: bytearray, cap: int) -> None:
        while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
            if len(into) + len(chunk) > cap:
                into.extend(chunk[: cap - len(into)])
                over.set()
                _kill(proc)
                break
            into.extend(chunk)

    readers = [
        threading.Thread(target=read, args=(proc.stdout, out, limits.output_bytes), daemon=True),
        threading.Thread(target=read, args=(proc.stderr, err, limits.output_bytes), daemon=True),
    ]
    for r in readers:
        r.start()
    try:
        assert proc.stdin is not None
        proc.stdin.write(code + stdin.encode())
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass  # it ended (or closed its stdin) before reading it all: its exit says why
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(proc)
        proc.wait()
    for r in readers:
        r.join(timeout=5)
    seconds = time.monotonic() - start
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    rc = proc.returncode
    outcome, reason = _judge(rc, stdout, stderr, expected, timed_out, over.is_set(), limits)
    return Execution(outcome, rc, stdout, stderr, seconds, reason)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its session: bubblewrap and everything it started
    except (ProcessLookupError, PermissionError):
        pass


def _judge(
    rc: int | None, stdout: str, stderr: str, expected: str | None, timed_out: bool, over: bool, limits: Limits
) -> tuple[Outcome, str]:
    if over:
        return Outcome.OUTPUT_LIMIT, f"wrote more than {limits.output_bytes} bytes"
    if timed_out:
        return Outcome.TIMEOUT, f"ran past {limits.wall_s} s of wall time"
    if rc is not None and rc < 0:
        sig = -rc
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return Outcome.TIMEOUT, f"ran past {limits.cpu_s} s of CPU time"
        return Outcome.CRASHED, f"killed by signal {signal.Signals(sig).name}"
    if rc is not None and rc > 128 and "bwrap:" not in stderr:  # bubblewrap passes a signal on as 128 + it
        sig = rc - 128
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return Outcome.TIMEOUT, f"ran past {limits.cpu_s} s of CPU time"
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return Outcome.CRASHED, f"killed by signal {name}"
    if "bwrap:" in stderr and rc not in (0, None):
        return Outcome.SANDBOX_ERROR, stderr.strip().splitlines()[-1][:200]
    if "MemoryError" in stderr:
        return Outcome.MEMORY, f"past {limits.memory_mb} MB of address space"
    if rc != 0:
        last = stderr.strip().splitlines()[-1][:200] if stderr.strip() else f"exit code {rc}"
        return Outcome.FAILED, last
    if expected is not None and _lines(stdout) != _lines(expected):
        return Outcome.FAILED, "wrong output"
    return Outcome.PASSED, ""


def _lines(text: str) -> list[str]:
    """Output compared as coding sets compare it: line by line, trailing spaces and blank ends ignored."""
    return [line.rstrip() for line in text.strip().splitlines()]
