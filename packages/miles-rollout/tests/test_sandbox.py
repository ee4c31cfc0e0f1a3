"""The sandbox for model-written code: outcomes, and the escape suite (each attempt contained, scored with its
reason, the host untouched, the next execution unaffected). Needs bubblewrap (scripts/setup-env.sh installs it)."""

import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from miles_rollout.sandbox import SANDBOX_UID_BASE, Limits, Outcome, Sandbox, SandboxError, check_sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

LIMITS = Limits(cpu_s=2, wall_s=6.0, memory_mb=256, processes=16, output_bytes=4096, file_mb=4)


@pytest.fixture(scope="module")
def box():
    sandbox = Sandbox("bwrap", LIMITS, workers=2)
    yield sandbox
    sandbox.close()


def test_outcomes_of_ordinary_programs(box):
    ok = box.run("print(sum(int(x) for x in input().split()))", "2 3\n", expected_stdout="5\n")
    assert ok.outcome is Outcome.PASSED, ok
    wrong = box.run("print(6)", "", expected_stdout="5")
    assert (wrong.outcome, wrong.reason) == (Outcome.FAILED, "wrong output")
    failed = box.run("def f(x):\n    return x + 1\nassert f(1) == 3, 'f(1) should be 3'")
    assert failed.outcome is Outcome.FAILED and "f(1) should be 3" in failed.reason, failed
    crashed = box.run("import ctypes; ctypes.string_at(0)")  # a real segfault
    assert crashed.outcome is Outcome.CRASHED and "SIGSEGV" in crashed.reason, crashed


def test_a_fork_bomb_is_contained(box):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = box.run(bomb)
    assert result.outcome is Outcome.TIMEOUT, result
    deadline = time.monotonic() + 5  # the kernel tears its process namespace down: nothing of it outlives that
    while _left_behind() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _left_behind(), _left_behind()
    assert box.run("print(1)", expected_stdout="1").outcome is Outcome.PASSED  # the next one runs as ever


def _left_behind() -> list[str]:
    """Processes still running under a sandbox uid (or, as another user, any bwrap of ours)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid = int(status.split("Uid:")[1].split()[0])
        if SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + 64:
            found.append(pid)
    return found


def test_host_files_are_not_there(box, tmp_path):
    secret = tmp_path / "miles.db"
    secret.write_text("tokens")
    for path in ("/etc/shadow", "/etc/passwd", str(secret), str(Path.home() / ".cache"), "/work", "/root"):
        result = box.run(f"open({path!r}).read()")
        assert result.outcome is Outcome.FAILED, (path, result)
        assert "FileNotFoundError" in result.reason or "IsADirectoryError" in result.reason, (path, result)
    env = box.run("import os; print(sorted(os.environ))")
    assert env.outcome is Outcome.PASSED and "MILES" not in env.stdout and "TOKEN" not in env.stdout.upper(), env


def test_writing_outside_the_sandbox_fails_and_leaves_nothing(box, tmp_path):
    target = tmp_path / "written"
    for path in (str(target), "/usr/evil", "/etc/evil"):
        result = box.run(f"open({path!r}, 'w').write('x')")
        assert result.outcome is Outcome.FAILED, (path, result)
    assert not target.exists() and not Path("/usr/evil").exists() and not Path("/etc/evil").exists()
    # its own /tmp is writable, limited, and gone afterwards
    inside = box.run("open('/tmp/mine', 'w').write('x'); print(open('/tmp/mine').read())", expected_stdout="x")
    assert inside.outcome is Outcome.PASSED, inside
    big = box.run("open('/tmp/big', 'wb').write(b'x' * (64 * 1024 * 1024))")
    assert big.outcome in (Outcome.FAILED, Outcome.CRASHED), big  # past file_mb (ENOSPC or SIGXFSZ)


def test_no_network(box):
    with socket.socket() as server:  # a port on the host's loopback: unreachable from inside
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        result = box.run(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert result.outcome is Outcome.FAILED and ("refused" in result.reason or "unreachable" in result.reason), (
            result
        )
    outside = box.run("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert outside.outcome is Outcome.FAILED, outside


def test_signalling_the_parent_reaches_nothing(box):
    me = os.getpid()
    result = box.run(f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({me}, signal.SIGKILL)")
    assert result.outcome is Outcome.FAILED and "ProcessLookupError" in result.reason, result
    assert box.run("print(2)", expected_stdout="2").outcome is Outcome.PASSED  # this process, alive


def test_an_infinite_loop_a_flood_of_output_and_a_huge_allocation(box):
    loop = box.run("while True:\n    pass")
    assert loop.outcome is Outcome.TIMEOUT, loop
    sleeper = box.run("import time; time.sleep(60)")
    assert sleeper.outcome is Outcome.TIMEOUT and "wall" in sleeper.reason, sleeper
    flood = box.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert flood.outcome is Outcome.OUTPUT_LIMIT and len(flood.stdout) <= LIMITS.output_bytes, flood
    gigabyte = box.run("print(1); sys = __import__('sys'); sys.stdout.write('y' * (1 << 30))")
    assert gigabyte.outcome in (Outcome.OUTPUT_LIMIT, Outcome.MEMORY), gigabyte
    huge = box.run("x = bytearray(8 * 1024 ** 3)")
    assert huge.outcome is Outcome.MEMORY, huge


def test_the_pool_runs_in_parallel_with_a_bounded_queue():
    sandbox = Sandbox("bwrap", LIMITS, workers=2, queue=2)
    try:
        start = time.monotonic()
        futures = [sandbox.submit("import time; time.sleep(1)") for _ in range(4)]
        results = [f.result() for f in futures]
        assert all(r.outcome is Outcome.PASSED for r in results), results
        assert time.monotonic() - start < 3.5  # 4 × 1 s on 2 workers, not 4 s in a row
    finally:
        sandbox.close()


def test_a_missing_tool_or_interpreter_is_refused_before_anything_runs(monkeypatch):
    with pytest.raises(SandboxError, match="python: "):
        check_sandbox("bwrap", "/usr/bin/no-such-python")
    with pytest.raises(SandboxError, match="outside /usr"):
        check_sandbox("bwrap", "/bin/sh")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError, match="bwrap is not installed"):
        check_sandbox("bwrap", "/usr/bin/python3")
