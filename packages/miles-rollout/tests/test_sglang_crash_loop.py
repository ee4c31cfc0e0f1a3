"""Issue 55, item 3: a server that crashes the same way on consecutive starts (a kernel its CPU path lacks) was
restarted three times over minutes and the job's error named only a log path. Recovery now gives up at the second
identical crash with the exception and the log's last lines, the restart budget stays for failures that differ, and
the router refuses at once when no server can come back.

The servers here are stand-ins: real processes that write a log and exit as a crashing SGLang server does (a real
one that fails on every request needs a model SGLang cannot run on CPU); `recover` and the router are the real code.
The real-server restart path is covered by test_sglang_router.py (kill -9 mid-rollout)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from miles_rollout.config import SGLangEngineConfig
from miles_rollout.engines.sglang.recovery import crash_cause, recover
from miles_rollout.engines.sglang.router import NoHealthyEngineError, Router, Slot

TRACEBACK = """[2026-12-07 10:00:0{n}] Scheduler hit an exception: Traceback (most recent call last):
  File "sglang/srt/managers/scheduler.py", line 2{n}1, in event_loop
    self.run_batch(batch)
NotImplementedError: sgl_kernel.{op} is not available on CPU (pid 41{n}7)
[2026-12-07 10:00:0{n}] Received sigquit from a child process. It usually means the child failed.
"""


class CrashingServer:
    """A stand-in for SGLangServer: a process that writes `log` and exits 1 at once."""

    def __init__(self, folder: Path, index: int, restart: int, log: str) -> None:
        self.index, self.url = index, f"http://127.0.0.1:{9000 + restart}"
        self.log_path = folder / f"sglang-{index}{f'.restart-{restart}' if restart else ''}.log"
        self.log_path.write_text(log)
        self.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
        self.process.wait()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        pass

    def wait_ready(self, timeout_s: float) -> None:
        pass


class NoWeights:
    def server_gone(self, slot: Slot) -> None:
        pass

    def verify(self, slot: Slot, version: int) -> None:
        pass


def test_the_same_crash_twice_gives_up_with_the_cause(tmp_path):
    config = SGLangEngineConfig(type="sglang", max_restarts=3)
    slot = Slot(0, "http://127.0.0.1:9000", server=CrashingServer(tmp_path, 0, 0, TRACEBACK.format(n=1, op="topk")))
    restarts = []

    def launch(index: int, restart: int) -> CrashingServer:  # the new process crashes as the first did
        return CrashingServer(tmp_path, index, restart, TRACEBACK.format(n=restart + 1, op="topk"))

    recover(slot, config, launch, NoWeights(), 0, restarts.append)  # the first crash: restarted
    assert [r.restart for r in restarts] == [1] and slot.last_crash.startswith("NotImplementedError: sgl_kernel.topk")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"crashed the same way twice: NotImplementedError: sgl_kernel.topk"):
        recover(slot, config, launch, NoWeights(), 0, restarts.append)
    assert time.monotonic() - started < 1 and len(restarts) == 1  # no second restart
    assert "last lines of" in slot.given_up and "Received sigquit" in slot.given_up
    assert str(tmp_path / "sglang-0.restart-1.log") in slot.given_up


def test_crashes_that_differ_use_the_restart_budget(tmp_path):
    config = SGLangEngineConfig(type="sglang", max_restarts=2)
    causes = ["MemoryError: out of memory\n", "Killed\n", "RuntimeError: NCCL timeout\n"]
    slot = Slot(0, "u", server=CrashingServer(tmp_path, 0, 0, causes[0]))

    def launch(index: int, restart: int) -> CrashingServer:
        return CrashingServer(tmp_path, index, restart, causes[restart])

    recover(slot, config, launch, NoWeights(), 0)
    recover(slot, config, launch, NoWeights(), 0)
    assert slot.restarts == 2 and slot.given_up is None
    with pytest.raises(RuntimeError, match=r"crashed after 2 restarts: RuntimeError: NCCL timeout"):
        recover(slot, config, launch, NoWeights(), 0)
    assert crash_cause(tmp_path / "sglang-0.restart-1.log") == "Killed"  # no exception line: the last line


def test_the_router_refuses_at_once_when_no_server_can_come_back():
    slots = [
        Slot(i, f"u{i}", admitted=False, given_up=f"sglang server {i} crashed the same way twice: X") for i in (0, 1)
    ]
    router = Router(slots, lambda slot: None, 5.0, 5.0, threading.Lock())
    started = time.monotonic()
    with pytest.raises(NoHealthyEngineError, match=r"no sglang server can serve: sglang server 0 crashed .*server 1"):
        asyncio.run(router.acquire(wait_s=600))
    assert time.monotonic() - started < 1
