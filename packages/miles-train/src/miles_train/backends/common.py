"""What the backend classes share beside the update: the constructor every backend is built with, the CPU
patches' guard, and, for the backends whose model is FSDP2-sharded DTensors (fsdp2, torchtitan), the AdamW
optimizer, the export and the checkpoint through full state dicts."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
from miles_train.backends.update import TrainerBase
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


class Backend(TrainerBase):
    """A trainer backend built from an HF model folder. `_set_up` sets `hf_config`, `model`, `optimizer` and, where
    the config needs one, `reference`; the policy is then put in train mode and the side models are built."""

    def __init__(
        self,
        config: TrainConfig,
        model_path: str | Path,
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
    ) -> None:
        super().__init__(config, rank, world_size, init_method)
        self.hf_config: Any = None
        self._set_up(model_path)
        self.pad_token_id = self.hf_config.pad_token_id or 0
        self.model.train()
        self._init_side_models(model_path)  # ppo's critic, distill's teacher record

    def _set_up(self, model_path: str | Path) -> None:
        raise NotImplementedError


class FullStateBackend(Backend):
    """A backend whose model is FSDP2-sharded: torch's AdamW, the export gathered whole on rank 0, and the common
    checkpoint (backends/checkpoint.py) with the full optimizer state. Subclasses give `_hf_state` (the HF-named
    tensors, collective, meaningful on rank 0) and `_from_hf` (a checkpoint's tensors as the model's state dict)."""

    checked_on_load: tuple[str, ...] = ()  # TrainerState fields a resumed checkpoint must match (load_checkpoint)

    def _adamw(self) -> torch.optim.Optimizer:
        opt = self.config.optimizer
        trained = [p for p in self.model.parameters() if p.requires_grad]  # a LoRA adapter's alone (train.lora)
        return torch.optim.AdamW(trained, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict with whole tensors (collective); on rank 0's host, empty on the others."""
        return get_model_state_dict(self.model, options=FULL_ON_HOST)

    def _hf_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _from_hf(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """On rank 0: the checkpoint's tensors under HF names (every rank takes part in the gather; a tied head is
        the embedding, exported once: miles_sync.naming); with `train.lora` and `sync.lora: adapter`, the adapter
        alone under PEFT's save names."""
        if self.config.lora is not None and self.lora_push == "adapter":
            adapter = self._adapter()
            if self.rank == 0:
                yield from adapter
            return
        state = self._hf_state()
        if self.rank == 0:
            yield from state.items()

    # ---- train.lora: the adapter (subclasses that take one give `_adapter_params` and `model_path`) -----------
    model_path: str = ""

    def _adapter_params(self) -> dict[str, torch.nn.Parameter]:
        """The adapter's parameters under their wire names (PEFT's save names)."""
        raise NotImplementedError

    def _adapter(self) -> list[tuple[str, torch.Tensor]]:
        """The adapter's matrices whole under PEFT's save names (collective), on every rank."""
        self._param_shards()  # reshards: the parameters below are the sharded ones
        return [(name, full_tensor(param).detach()) for name, param in self._adapter_params().items()]

    def save(self, directory: str | Path) -> None:
        """The common checkpoint with the full optimizer state: loadable on any number of ranks (torchtitan: of
        the same padded vocabulary). With `train.lora`: the merged weights (loadable as an HF model), the adapter's
        optimizer state, and the adapter in PEFT's layout under `adapter/`."""
        weights = self._hf_state()
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=FULL_ON_HOST)
        save_checkpoint(directory, self.rank, self.hf_config, weights, self._state(), optim_state)
        self._save_side_models(directory)
        if self.config.lora is not None:
            adapter = self._adapter()
            if self.rank == 0:
                kwargs = self.config.lora.peft_kwargs()
                lora.save_adapter(Path(directory) / lora.ADAPTER_DIR, kwargs, self.model_path, adapter)
            dist.barrier()

    def load(self, directory: str | Path) -> None:
        """Resume from `save`'s folder: weights, optimizer state, step and side models."""
        ckpt = load_checkpoint(directory, self._state(), self.checked_on_load)
        full = StateDictOptions(full_state_dict=True)
        self._load_weights(Path(directory), ckpt.hf_state)
        set_optimizer_state_dict(self.model, self.optimizer, ckpt.optimizer_state, options=full)
        self.step = ckpt.state.step
        self._load_side_models(directory)

    def _load_weights(self, directory: Path, hf_state: dict[str, torch.Tensor]) -> None:
        """Full fine-tuning: the checkpoint's weights (its HF tensors, `hf_state`). With `train.lora`: its adapter
        (`adapter/`), onto the job's base model; a checkpoint and a job that disagree on having one are refused,
        naming train.lora."""
        folder = directory / lora.ADAPTER_DIR
        if self.config.lora is None:
            if folder.is_dir():
                raise ValueError(
                    f"train.lora: checkpoint {directory} holds a LoRA adapter (its base frozen, the optimizer state "
                    "the adapter's); resume it with train.lora set as it was, or export its merged weights "
                    "(`miles export --merged`) and start a full fine-tuning job from them"
                )
            state = self._from_hf(hf_state)
            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
            return
        if not folder.is_dir():
            raise ValueError(
                f"train.lora: checkpoint {directory} holds no adapter (it was written by full fine-tuning); start the "
                "LoRA job from its weights as the model (model.path) instead of resuming it"
            )
        saved, tensors = lora.read_adapter(folder)
        lora.check_same_adapter(saved, self.config.lora.peft_kwargs(), str(folder))
        params = self._adapter_params()
        missing = sorted(set(params) - set(tensors))
        if missing:
            raise ValueError(f"train.lora: the adapter in {folder} lacks {len(missing)} matrices, e.g. {missing[:2]}")
        self._param_shards()  # reshards: the parameters below are the sharded ones
        with torch.no_grad():
            for name, param in params.items():
                value = tensors[name].to(device=self.device, dtype=param.dtype)
                if hasattr(param, "device_mesh"):
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value, param.device_mesh, param.placements)
                param.copy_(value)

    def _state(self) -> TrainerState:
        raise NotImplementedError
