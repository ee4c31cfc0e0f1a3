"""FSDP2 trainer backend: the HF model (`convert.py`), `fully_shard` per layer (`parallelize.py`), gloo on CPU /
NCCL on GPU, the shared GRPO update."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from miles_train.backends.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from miles_train.backends.fsdp2 import convert
from miles_train.backends.fsdp2.parallelize import apply_fsdp
from miles_train.backends.update import TrainerBase
from miles_train.collate import Collated
from miles_train.config import TrainConfig

log = logging.getLogger(__name__)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FSDP2Backend(TrainerBase):
    """One data-parallel rank of an HF model sharded with FSDP2; gradients are averaged by FSDP2."""

    name = "fsdp2"

    def __init__(
        self,
        config: TrainConfig,
        model_path: str | Path,
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
    ) -> None:
        super().__init__(config, rank, world_size, init_method)
        self.loss_scale = float(world_size)  # FSDP2 averages over ranks: × world_size gives the global token mean
        self.model = self._load(model_path)
        self.model.train()
        self.pad_token_id = self.model.config.pad_token_id or 0
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        if config.needs_reference:  # the KL reference (the checkpoint) or distill's teacher
            self.reference = self._load(config.reference_path(model_path)).eval().requires_grad_(False)
        self._init_side_models(model_path)  # ppo's critic, distill's teacher record
        self.scaler = None
        if config.precision == "fp16":  # dynamic loss scaling; found-inf is agreed on across the ranks
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=self.device.type)

    def _load(self, model_path: str | Path) -> torch.nn.Module:
        model = convert.load_hf_model(model_path, self.device)
        return apply_fsdp(model, self.config.precision)

    def _logits(self, model: torch.nn.Module, c: Collated) -> torch.Tensor:
        return model(input_ids=c.input_ids, attention_mask=c.attention_mask).logits

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def _step_optimizer(self) -> float | None:
        norm = None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients
        if self.config.optimizer.max_grad_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optimizer.max_grad_norm)
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        if self.scaler is None:
            self.optimizer.step()
            return norm
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)  # skipped when a gradient overflowed
        self.scaler.update()
        if self.scaler.get_scale() < scale:  # the scale backs off exactly when the step was skipped
            self.overflow_skips += 1
            return None  # the norm of overflowed gradients is inf or NaN: not a measurement
        return norm

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors: a tied head is the embedding, exported once (miles_sync.naming)."""
        state = get_model_state_dict(self.model, options=_FULL)
        if self.rank == 0:
            yield from convert.to_hf(self.model.config, state)

    def export_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters as FSDP2 holds them: `Shard(0)` DTensors under HF names (the model is the
        transformers model), with no collective; the `p2p` transport sends each rank's rows itself."""
        yield from convert.to_hf(self.model.config, get_model_state_dict(self.model))

    def _state(self) -> TrainerState:
        return TrainerState(self.name, self.step, self.world_size)

    def save(self, directory: str | Path) -> None:
        """The common checkpoint (backends/checkpoint.py) with the full optimizer state: loadable on any
        number of ranks."""
        model_state = get_model_state_dict(self.model, options=_FULL)
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)
        save_checkpoint(directory, self.rank, self.model.config, model_state, self._state(), optim_state)
        self._save_side_models(directory)

    def load(self, directory: str | Path) -> None:
        ckpt = load_checkpoint(directory, self._state())
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, convert.from_hf(self.model.config, ckpt.hf_state), options=full)
        set_optimizer_state_dict(self.model, self.optimizer, ckpt.optimizer_state, options=full)
        self.step = ckpt.state.step
        self._load_side_models(directory)
