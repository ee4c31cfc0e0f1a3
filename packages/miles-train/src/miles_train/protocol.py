"""The trainer's two protocols: `TrainerBackend`, what one trainer rank offers the schedules (implemented once, by
`backends/trainer.py:Trainer`), and `Backend`, the small part a training framework provides to it (implemented by
one class per framework: `backends/fsdp2`, `backends/megatron`, `backends/torchtitan`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from miles_train.collate import Collated
from miles_train.types import TrainBatch


@runtime_checkable
class TrainerBackend(Protocol):
    """One rank of a trainer. Every rank of a job calls each method with the same arguments
    (collectives inside); results that are not per-rank are the same on every rank."""

    name: str
    rank: int
    world_size: int

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One GRPO update on `batch`; returns metrics (`train/loss`, `train/kl`, `train/entropy`, ...)."""
        ...

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Per-token logprobs of every response under the current weights."""
        ...

    def set_push_dtype(self, dtype: str | None) -> None:
        """The dtype the engines hold the weights in. When it is narrower than the master weights, the backend
        forwards with the weights as pushed (`train.policy_weights`) and reports `train/update_kept_frac`."""
        ...

    def set_lora_push(self, mode: str) -> None:
        """With `train.lora`: whether `export_weights` gives the adapter alone (`adapter`) or the merged weights
        (`merge`), `sync.lora`."""
        ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under HF names, as a checkpoint holds them (a tied head once, as the
        embedding: miles_sync.naming); with `train.lora` and `set_lora_push("adapter")`, the adapter's matrices
        under PEFT's save names. Collective: call on every rank; rank 0 yields them.

        The tensors may alias live parameters: consume or copy them before the next `train_step`.
        """
        ...

    def export_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What this rank holds, under HF names, for a transport that sends from every rank (`p2p`): row shards
        as `Shard(0)` DTensors, or whole tensors. Backends that cannot send their layout as it is gather like
        `export_weights` (rank 0 yields every tensor, the others none). Call on every rank."""
        ...

    def save(self, directory: str | Path) -> None: ...

    def load(self, directory: str | Path) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class Rank:
    """Where a backend runs: the job's training settings, this rank of `world_size` (its default process group
    joined already) and its device."""

    config: Any  # miles_train.config.TrainConfig
    rank: int
    world_size: int
    device: torch.device


@runtime_checkable
class Backend(Protocol):
    """What a training framework provides the `Trainer`, which runs the update (advantages, the loss terms,
    minibatches, metrics), the side models (PPO's critic, a teacher's record) and the weights as pushed around it.

    A backend builds the policy (`model`) and, where the config needs one, the frozen `reference`, both from an HF
    folder (`hf_config`), over its parallel layout: this rank trains on rows `dp_rank::dp_size` of a batch
    (tensor-parallel peers share rows) and multiplies its local loss by `loss_scale` so that its gradient reduction
    gives the global token mean (dp_size where it averages, 1 where it sums)."""

    name: str
    model: Any
    reference: Any
    hf_config: Any
    dp_rank: int
    dp_size: int
    loss_scale: float
    overflow_skips: int  # optimizer steps skipped for an fp16 overflow since the start

    def logits(self, model: Any, c: Collated) -> torch.Tensor:
        """[B, T, V] logits of `model` (the policy or the reference) over the full vocabulary."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (local) loss; with fp16 loss scaling, scaled first."""
        ...

    def step_optimizer(self) -> float | None:
        """Reduce gradients, clip to `optimizer.max_grad_norm` (measure only, where it is None), step; the global
        norm before clipping, or None when the step was skipped (an fp16 overflow)."""
        ...

    def zero_grad(self) -> None: ...

    def dp_group(self) -> Any:
        """The process group of this rank's data-parallel peers (None: every rank)."""
        ...

    def replicas(self, param: torch.Tensor) -> int:
        """How many ranks hold the local data of `param` (so that global counts take each element once)."""
        ...

    def export_weights(self, adapter_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective; rank 0 yields the checkpoint's tensors under HF names (a tied head once), or with
        `adapter_only` (train.lora, sync.lora: adapter) the adapter's matrices under PEFT's save names."""
        ...

    def export_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What this rank holds under HF names, for a transport that sends from every rank (`p2p`)."""
        ...

    def save(self, directory: str | Path, step: int) -> None:
        """The common checkpoint (backends/checkpoint.py): weights, optimizer state, `step`."""
        ...

    def load(self, directory: str | Path) -> int:
        """Resume from `save`'s folder (weights, optimizer state); the step it was saved at."""
        ...

    def shutdown(self) -> None:
        """Tear the framework's own state down (its parallel groups); the trainer closes the default group."""
        ...
