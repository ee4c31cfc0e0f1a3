"""Backend factory: the only place that branches on the backend type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_train.config import BackendConfig, TrainConfig
from miles_train.protocol import TrainerBackend


def check_model(config: BackendConfig, hf_config: Any) -> None:
    """Raise ValueError naming the config.json field of `hf_config` the backend cannot train (before any rank
    starts). fsdp2 trains the transformers model itself, so it takes any causal LM transformers builds."""
    if config.type == "megatron":
        from miles_train.backends.megatron.convert import check_supported

        check_supported(hf_config, config.tensor_parallel_size, config.expert_parallel_size)
    elif config.type == "torchtitan":
        from miles_train.backends.torchtitan.convert import check_supported

        check_supported(hf_config, config.tensor_parallel_size)


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
