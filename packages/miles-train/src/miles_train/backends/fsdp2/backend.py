"""FSDP2 trainer backend: the HF model (`convert.py`), `fully_shard` per layer (`parallelize.py`), gloo on CPU /
NCCL on GPU, the shared GRPO update. With `train.lora` the model is wrapped by PEFT before it is sharded
(miles_train.lora): the base frozen, the optimizer over the adapter, pushes of the adapter or the merged weights,
checkpoints with the adapter in PEFT's layout. `train.freeze` turns off the named parameters before sharding."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from miles_train import lora
from miles_train.backends.checkpoint import TrainerState
from miles_train.backends.common import adamw, export_full, full_state, full_tensor, load_full, save_full
from miles_train.backends.fsdp2 import convert
from miles_train.backends.fsdp2.parallelize import apply_fsdp
from miles_train.backends.weights_as import dtensor_replicas
from miles_train.collate import Collated
from miles_train.freeze import freeze as frozen_by
from miles_train.protocol import Rank

log = logging.getLogger(__name__)


class FSDP2Backend:
    """One data-parallel rank of an HF model sharded with FSDP2 (a `miles_train.protocol.Backend`); gradients are
    averaged by FSDP2."""

    name = "fsdp2"

    def __init__(self, where: Rank, model_path: str | Path) -> None:
        self.config, self.rank, self.world_size, self.device = where.config, where.rank, where.world_size, where.device
        self.dp_rank, self.dp_size = self.rank, self.world_size
        self.overflow_skips = 0
        self.reference: torch.nn.Module | None = None
        self.loss_scale = float(self.world_size)  # FSDP2 averages over ranks: × world_size gives the global token mean
        self.model_path = str(model_path)
        self.frozen: list[str] = []  # train.freeze: the parameters it names (no gradient, no optimizer state)
        self.model = self._load(model_path, adapter=self.config.lora is not None, freeze=True)
        self.hf_config = self.model.config
        self.optimizer = adamw(self.model, self.config)
        if self.config.needs_reference and self.config.reference_is_base:  # LoRA: the base under the adapter
            self.reference = lora.AdapterOff(self.model)
        elif self.config.needs_reference:  # the KL reference (the checkpoint) or distill's teacher
            self.reference = self._load(self.config.reference_path(model_path)).eval().requires_grad_(False)
        self.scaler = None
        if self.config.precision == "fp16":  # dynamic loss scaling; found-inf is agreed on across the ranks
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device=self.device.type)

    def _load(self, model_path: str | Path, adapter: bool = False, freeze: bool = False) -> torch.nn.Module:
        model = convert.load_hf_model(model_path, self.device)
        if freeze and self.config.freeze:  # before sharding: FSDP2 keeps each parameter's requires_grad
            self.frozen = frozen_by(model, self.config.freeze)
        if adapter:  # PEFT wraps the transformers modules; FSDP2 then shards the wrapped model
            assert self.config.lora is not None
            model = lora.wrap(model, self.config.lora.peft_kwargs(), model_path)
        return apply_fsdp(model, self.config.precision)

    # ---- the protocol -------------------------------------------------------------------------
    def logits(self, model: torch.nn.Module, c: Collated) -> torch.Tensor:
        return model(input_ids=c.input_ids, attention_mask=c.attention_mask, **c.model_inputs).logits

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def dp_group(self) -> None:
        return None  # every rank is a data-parallel peer

    def replicas(self, param: torch.Tensor) -> int:
        return dtensor_replicas(param, self.world_size)

    def export_weights(self, adapter_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
        return export_full(self, adapter_only)

    def save(self, directory: str | Path, step: int) -> None:
        save_full(self, directory, TrainerState(self.name, step, self.world_size))

    def load(self, directory: str | Path) -> int:
        return load_full(self, directory, TrainerState(self.name, 0, self.world_size))

    def shutdown(self) -> None:
        """FSDP2 keeps no groups of its own."""

    def step_optimizer(self) -> float | None:
        norm = None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients
        # An infinite bound measures the norm without clipping: train/grad_norm is the real norm either way.
        limit = self.config.optimizer.max_grad_norm or float("inf")
        total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit)
        norm = float(full_tensor(total))
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

    # ---- full state (backends/common.py) -------------------------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under HF names on rank 0 (collective); with an adapter, the merged weights."""
        state = full_state(self.model)
        if self.config.lora is not None and self.rank == 0:
            state = lora.merged(state, lora.scaling_of(self.config.lora.peft_kwargs()))
        return dict(convert.to_hf(lora.base_model(self.model), state)) if self.rank == 0 else {}

    def adapter_params(self) -> dict[str, torch.nn.Parameter]:
        return lora.adapter_params(self.model)

    def from_hf(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return convert.from_hf(lora.base_model(self.model), hf_state)

    def export_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters as FSDP2 holds them: `Shard(0)` DTensors under HF names (the model is the
        transformers model), with no collective; the `p2p` transport sends each rank's rows itself. (Not with
        `train.lora`: the job spec refuses p2p there.)"""
        if self.config.lora is not None:
            raise ValueError(
                "train.lora: an adapter is pushed whole from rank 0, not as row shards (sync.transport p2p)"
            )
        state = get_model_state_dict(self.model)
        fused = convert.converted(self.model, state)
        if fused:
            raise ValueError(
                f"sync.transport p2p: this model holds {len(fused)} tensors in another layout than its checkpoint "
                f"(e.g. {fused[0]}: a mixture of experts' fused expert weights), which a row shard cannot be pushed "
                "as; use sync.transport disk, shm or broadcast"
            )
        yield from convert.to_hf(self.model, state)
