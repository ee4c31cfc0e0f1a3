"""Backend factory: the only place that branches on the backend type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_train.config import BackendConfig, TrainConfig
from miles_train.protocol import Backend, TrainerBackend


def check_model(config: BackendConfig, hf_config: Any) -> None:
    """Raise ValueError naming the config.json field of `hf_config` the backend cannot train (before any rank
    starts). fsdp2 trains the transformers model itself, so it takes any causal LM transformers builds, and the
    vision-language families of `miles_sync.vision` with their tower; megatron and torchtitan rebuild text models
    only."""
    from miles_sync.vision import is_vision_language

    if config.type != "fsdp2" and is_vision_language(hf_config):
        raise ValueError(
            f"train.backend.type: {config.type} rebuilds text models only, and config.json model_type "
            f"{getattr(hf_config, 'model_type', '?')!r} is a vision-language model (a vision_config); use fsdp2"
        )
    if config.type == "megatron":
        from miles_train.backends.megatron.convert import check_supported

        check_supported(hf_config, config.tensor_parallel_size, config.expert_parallel_size)
    elif config.type == "torchtitan":
        from miles_train.backends.torchtitan.convert import check_supported

        check_supported(hf_config, config.tensor_parallel_size)


def build_backend(
    config: TrainConfig, model_path: str | Path, rank: int = 0, world_size: int = 1, init_method: str | None = None
) -> TrainerBackend:
    """One rank of a trainer: the `Trainer` (backends/trainer.py) over the framework `config.backend.type` names."""
    from miles_train.backends.trainer import Trainer

    return Trainer(config, model_path, backend_class(config.backend.type), rank, world_size, init_method)


def backend_class(backend_type: str) -> type[Backend]:
    """The class of the framework `backend_type` names (each a `miles_train.protocol.Backend`)."""
    if backend_type == "fsdp2":
        from miles_train.backends.fsdp2.backend import FSDP2Backend

        return FSDP2Backend
    if backend_type == "megatron":
        from miles_train.backends.megatron.backend import MegatronBackend

        return MegatronBackend
    if backend_type == "torchtitan":
        from miles_train.backends.torchtitan.backend import TorchtitanBackend

        return TorchtitanBackend
    raise ValueError(f"unknown trainer backend {backend_type!r}")
