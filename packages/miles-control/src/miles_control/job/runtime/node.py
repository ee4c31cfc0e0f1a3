"""Where an actor runs: its Ray node, the CPU cores it may use, an address for a rendezvous it hosts."""

from __future__ import annotations

import os
import socket


def free_port_and_ip() -> tuple[str, int]:
    """An address for torch.distributed's rendezvous, found on the node that will host rank 0."""
    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind(("", 0))
        return ip, s.getsockname()[1]


def pin_to(cpus: list[int] | None) -> None:
    """Restrict this process (and the processes it starts) to `cpus`, with torch threads to match."""
    if cpus:
        import torch

        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))


def repin(cpus: list[int]) -> None:
    """Move this process, its torch threads and the processes it started (an engine's servers, which keep the
    thread count they started with) to `cpus`: the split following the measured stage costs."""
    import psutil

    pin_to(cpus)
    for child in psutil.Process().children(recursive=True):
        try:
            child.cpu_affinity(cpus)
        except psutil.Error:  # gone meanwhile
            pass


def node_id() -> str:
    """The Ray node this process runs on."""
    import ray

    return ray.get_runtime_context().get_node_id()
