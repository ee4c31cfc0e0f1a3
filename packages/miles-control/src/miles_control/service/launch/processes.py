"""What the launcher knows about processes of this machine: open ports, /proc (command lines, start
times), process groups, and Ray's record of the local cluster."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def arg_after(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def process_start(pid: int) -> float | None:
    """When a process started (unix seconds), from /proc; None if it does not exist."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    except (OSError, StopIteration):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in ticks


def kill_process_group(pgid: int, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s` (Ray's gcs_server ignores SIGTERM for a long while). A group id of
    0 or 1 (from a damaged state file) would be this process's own group or init's: never signalled."""
    if pgid <= 1 or pgid == os.getpgrp():
        return
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
