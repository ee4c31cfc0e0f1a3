"""Backend factory: the only place that branches on the backend type."""

from __future__ import annotations

from pathlib import Path

from miles_train.config import TrainConfig
from miles_train.protocol import TrainerBackend


def build_backend(
    config: TrainConfig, model_path: str | Path, rank: int = 0, world_size: int = 1, init_method: str | None = None
) -> TrainerBackend:
    if config.backend.type == "fsdp2":
        from miles_train.backends.fsdp2.backend import FSDP2Backend

        return FSDP2Backend(config, model_path, rank=rank, world_size=world_size, init_method=init_method)
    if config.backend.type == "megatron":
        from miles_train.backends.megatron.backend import MegatronBackend

        return MegatronBackend(config, model_path, rank=rank, world_size=world_size, init_method=init_method)
    if config.backend.type == "torchtitan":
        from miles_train.backends.torchtitan.backend import TorchtitanBackend

        return TorchtitanBackend(config, model_path, rank=rank, world_size=world_size, init_method=init_method)
    raise ValueError(f"unknown trainer backend {config.backend.type!r}")
