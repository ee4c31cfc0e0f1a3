"""The TrainerBackend protocol: what every training backend offers the schedules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

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
