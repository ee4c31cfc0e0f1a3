"""What each worker uses, sampled by the worker itself (psutil): CPU (in % of one core, summed over the process and
its children, e.g. a rollout actor's SGLang servers), resident memory, and on GPU the memory torch allocated.
Recorded per step as `sys/<worker>/cpu_pct`, `sys/<worker>/rss_mb` and `sys/<worker>/gpu_mem_mb` metrics; the
dashboard's Resources tab plots them."""

from __future__ import annotations

import os

import psutil

MB = float(1 << 20)


class ProcessUsage:
    """CPU and memory of a process and its descendants since the previous sample (the first one reads 0 % CPU)."""

    def __init__(self, pid: int | None = None) -> None:
        self.process = psutil.Process(pid or os.getpid())
        self.process.cpu_percent(None)
        self._children: dict[int, psutil.Process] = {}

    def sample(self) -> dict[str, float]:
        cpu = self.process.cpu_percent(None)
        rss = self.process.memory_info().rss
        alive: dict[int, psutil.Process] = {}
        for child in self.process.children(recursive=True):
            known = self._children.get(child.pid, child)
            try:
                cpu += known.cpu_percent(None)  # 0 the first time a child is seen
                rss += known.memory_info().rss
            except psutil.Error:  # ended between the listing and the reading
                continue
            alive[child.pid] = known
        self._children = alive
        return {"cpu_pct": cpu, "rss_mb": rss / MB}


def gpu_memory_mb() -> dict[str, float]:
    """The peak memory torch allocated on this process's GPU since the last call (none on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    peak = torch.cuda.max_memory_allocated() / MB
    torch.cuda.reset_peak_memory_stats()
    return {"gpu_mem_mb": peak}


def prefixed(worker: str, values: dict[str, float]) -> dict[str, float]:
    return {f"sys/{worker}/{key}": float(value) for key, value in values.items()}
