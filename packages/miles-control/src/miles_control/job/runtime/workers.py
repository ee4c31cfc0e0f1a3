"""The Ray actors of a job. Plain classes here; `ray.remote` is applied where they are started.

The trainer rank is here; the rollout actor is in `rollout_worker.py`, what the actors answer in `answers.py`, and
where they run (node, cores, rendezvous address) in `node.py`; all of them are importable from here.
"""

from __future__ import annotations

import os
import time
from typing import Any

from miles_control.job.runtime.answers import Evaluated, Published, TakenBatch, Timed, TrainResult
from miles_control.job.runtime.node import free_port_and_ip, node_id, pin_to, repin
from miles_control.job.runtime.rollout_worker import RolloutWorker
from miles_control.job.runtime.usage import ProcessUsage, gpu_memory_mb, prefixed

__all__ = [
    "Evaluated",
    "Published",
    "RolloutWorker",
    "TakenBatch",
    "Timed",
    "TrainResult",
    "TrainerWorker",
    "free_port_and_ip",
    "node_id",
    "pin_to",
]


class TrainerWorker:
    """One trainer rank. Rank 0 also owns the weight sender."""

    def __init__(
        self,
        spec: dict[str, Any],
        model_path: str,
        rank: int,
        world_size: int,
        init_method: str,
        weights_dir: str,
        receiver_ranks: int = 1,
        cpus: list[int] | None = None,
        pushed_precision: str = "float32",
    ) -> None:
        import faulthandler

        import torch

        from miles_control.spec.config import JobSpec
        from miles_sync import build_sender, sends_from_every_rank
        from miles_train import build_backend

        faulthandler.enable()  # a crash in native code leaves a Python stack in the worker's log

        job = JobSpec.model_validate(spec)
        torch.manual_seed(job.seed + rank)
        if job.train.backend.num_threads is None:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        pin_to(cpus)
        self.rank = rank
        self._usage = ProcessUsage()
        self.backend = build_backend(job.train, model_path, rank, world_size, init_method)
        # the policy the engines run: what the trainer forwards with, and recomputes the ratio's denominator under
        self.backend.set_push_dtype(pushed_precision, job.sync.quantization, job.sync.quant_group_size)
        self.backend.set_lora_push(job.sync.lora)  # with train.lora: the adapter, or the merged weights
        self.sender = None
        if rank == 0 or sends_from_every_rank(job.sync):
            self.sender = build_sender(job.sync.placed(weights_dir), receiver_ranks=receiver_ranks)

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this rank (its CUDA_VISIBLE_DEVICES); empty on CPU."""
        import ray

        return [str(gpu) for gpu in ray.get_gpu_ids()]

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        return node_id()

    def repin(self, cpus: list[int]) -> None:
        """Run on `cpus` from now on (the cost-following CPU split)."""
        repin(cpus)

    def train_step(self, batch) -> TrainResult:
        """One optimizer step on `batch`, with this rank's resource use since the last step."""
        start = time.time()
        metrics = self.backend.train_step(batch)
        end = time.time()
        metrics.update(prefixed(f"trainer{self.rank}", self._usage.sample() | gpu_memory_mb()))  # since the last step
        return TrainResult(start, end, metrics)

    def publish_weights(self, weight_version: int) -> Published:
        """Gather full weights (collective on every rank) and publish them from rank 0; or, for a transport that
        sends from every rank, publish what this rank holds."""
        start = time.time()
        every_rank = self.sender is not None and self.sender.from_every_rank
        named = self.backend.export_shards() if every_rank else self.backend.export_weights()
        handle = None
        if self.sender is not None:
            handle = self.sender.publish(named, weight_version)
        else:
            for _ in named:  # drive the collective on non-zero ranks
                pass
        return Published(start, time.time(), handle)

    def wait_published(self) -> None:
        """Transports that send in the background (broadcast) finish here and report their errors."""
        if self.sender is not None:
            self.sender.wait()

    def save(self, directory: str) -> None:
        """Save the backend's checkpoint under `directory`."""
        self.backend.save(directory)

    def load(self, directory: str) -> None:
        """Load the backend's checkpoint from `directory`."""
        self.backend.load(directory)

    def shutdown(self) -> None:
        """Close the weight sender and the backend."""
        if self.sender is not None:
            self.sender.close()
        self.backend.shutdown()
