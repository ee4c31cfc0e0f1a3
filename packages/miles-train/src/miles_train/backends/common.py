"""Helpers the backend classes share, as functions: the CPU patches' guard, and, for the backends whose model is
FSDP2-sharded DTensors (fsdp2, torchtitan: a `FullState`), the AdamW optimizer, the export and the checkpoint
through full state dicts, with a LoRA adapter's matrices beside them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from miles_train import lora
from miles_train.backends.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from miles_train.backends.weights_as import param_shards
from miles_train.config import TrainConfig

FULL_ON_HOST = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's host only


def on_host() -> bool:
    """True on a machine without a GPU, where the backends' CPU adjustments (`cpu.py`) apply."""
    return not torch.cuda.is_available()


def once_on_host(patch: Callable[[], None]) -> Callable[[], None]:
    """`patch` run at most once per process, and never where CUDA is present."""
    applied = False

    @functools.wraps(patch)
    def apply() -> None:
        nonlocal applied
        if applied or not on_host():
            return
        applied = True
        patch()

    return apply


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class FullState(Protocol):
    """A backend whose model is FSDP2-sharded: what the helpers below read of it."""

    config: TrainConfig
    rank: int
    device: torch.device
    model: Any
    optimizer: Any
    hf_config: Any
    model_path: str

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The HF-named tensors (collective), meaningful on rank 0 (with an adapter: the merged weights)."""
        ...

    def from_hf(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors as the model's state dict."""
        ...

    def adapter_params(self) -> dict[str, torch.nn.Parameter]:
        """train.lora: the adapter's parameters under their wire names (PEFT's save names)."""
        ...


def adamw(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """torch's AdamW over the trained parameters (a LoRA adapter's alone, with train.lora)."""
    opt = config.optimizer
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trained, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with whole tensors (collective); on rank 0's host, empty on the others."""
    return get_model_state_dict(model, options=FULL_ON_HOST)


def whole_adapter(backend: FullState) -> list[tuple[str, torch.Tensor]]:
    """The adapter's matrices whole under PEFT's save names (collective), on every rank."""
    param_shards(backend.model)  # reshards: the parameters below are the sharded ones
    return [(name, full_tensor(param).detach()) for name, param in backend.adapter_params().items()]


def export_full(backend: FullState, adapter_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """On rank 0: the checkpoint's tensors under HF names (every rank takes part in the gather; a tied head is the
    embedding, exported once: miles_sync.naming); with `adapter_only`, the adapter alone under PEFT's save names."""
    if adapter_only:
        adapter = whole_adapter(backend)
        if backend.rank == 0:
            yield from adapter
        return
    state = backend.hf_state()
    if backend.rank == 0:
        yield from state.items()


def save_full(backend: FullState, directory: str | Path, state: TrainerState) -> None:
    """The common checkpoint with the full optimizer state: loadable on any number of ranks (torchtitan: of the same
    padded vocabulary). With `train.lora`: the merged weights (loadable as an HF model), the adapter's optimizer
    state, and the adapter in PEFT's layout under `adapter/`."""
    weights = backend.hf_state()
    optim_state = get_optimizer_state_dict(backend.model, backend.optimizer, options=FULL_ON_HOST)
    save_checkpoint(directory, backend.rank, backend.hf_config, weights, state, optim_state)
    if backend.config.lora is not None:
        adapter = whole_adapter(backend)
        if backend.rank == 0:
            kwargs = backend.config.lora.peft_kwargs()
            lora.save_adapter(Path(directory) / lora.ADAPTER_DIR, kwargs, backend.model_path, adapter)
        dist.barrier()


def load_full(backend: FullState, directory: str | Path, mine: TrainerState, must_match: tuple[str, ...] = ()) -> int:
    """Resume from `save_full`'s folder: weights and optimizer state; the step it was saved at."""
    ckpt = load_checkpoint(directory, mine, must_match)
    full = StateDictOptions(full_state_dict=True)
    _load_weights(backend, Path(directory), ckpt.hf_state)
    set_optimizer_state_dict(backend.model, backend.optimizer, ckpt.optimizer_state, options=full)
    return ckpt.state.step


def _load_weights(backend: FullState, directory: Path, hf_state: dict[str, torch.Tensor]) -> None:
    """Full fine-tuning: the checkpoint's weights (its HF tensors, `hf_state`). With `train.lora`: its adapter
    (`adapter/`), onto the job's base model; a checkpoint and a job that disagree on having one are refused, naming
    train.lora."""
    folder = directory / lora.ADAPTER_DIR
    config = backend.config.lora
    if config is None:
        if folder.is_dir():
            raise ValueError(
                f"train.lora: checkpoint {directory} holds a LoRA adapter (its base frozen, the optimizer state "
                "the adapter's); resume it with train.lora set as it was, or export its merged weights "
                "(`miles export --merged`) and start a full fine-tuning job from them"
            )
        state = backend.from_hf(hf_state)
        set_model_state_dict(backend.model, state, options=StateDictOptions(full_state_dict=True))
        return
    if not folder.is_dir():
        raise ValueError(
            f"train.lora: checkpoint {directory} holds no adapter (it was written by full fine-tuning); start the "
            "LoRA job from its weights as the model (model.path) instead of resuming it"
        )
    saved, tensors = lora.read_adapter(folder)
    lora.check_same_adapter(saved, config.peft_kwargs(), str(folder))
    params = backend.adapter_params()
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise ValueError(f"train.lora: the adapter in {folder} lacks {len(missing)} matrices, e.g. {missing[:2]}")
    param_shards(backend.model)  # reshards: the parameters below are the sharded ones
    with torch.no_grad():
        for name, param in params.items():
            value = tensors[name].to(device=backend.device, dtype=param.dtype)
            if hasattr(param, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value, param.device_mesh, param.placements)
            param.copy_(value)
