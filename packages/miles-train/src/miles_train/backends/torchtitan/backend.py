"""torchtitan trainer backend: a Qwen2/Llama-family torchtitan model parallelised by torchtitan
(`parallelize.py`: TP over `tensor_parallel_size` ranks, FSDP2 over the data-parallel ranks), HF weights in
and out through its state-dict adapter (`convert.py`). fp32. With `train.lora`, PEFT injects the adapter into
torchtitan's linears before they are parallelised (`convert.py`); it is pushed, saved and resumed under the names it
has on the HF model, as fsdp2's is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from miles_train import lora
from miles_train.backends.checkpoint import TrainerState
from miles_train.backends.common import adamw, export_full, full_state, full_tensor, load_full, save_full
from miles_train.backends.distributed import pad_rows, padded_vocab
from miles_train.backends.hf_family import load_checked_config
from miles_train.backends.hf_io import read_hf_state
from miles_train.backends.torchtitan import convert, cpu, parallelize
from miles_train.backends.weights_as import dtensor_replicas
from miles_train.collate import Collated
from miles_train.protocol import Rank

log = logging.getLogger(__name__)

_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


class TorchtitanBackend:
    """One rank of a torchtitan model: TP over `tensor_parallel_size` ranks, FSDP2 over the data-parallel ones (a
    `miles_train.protocol.Backend`); gradients are averaged over the data-parallel ranks."""

    name = "torchtitan"

    def __init__(self, where: Rank, model_path: str | Path) -> None:
        self.config, self.rank, self.world_size, self.device = where.config, where.rank, where.world_size, where.device
        self.overflow_skips = 0  # fp32 only: no loss scaling
        self.reference: torch.nn.Module | None = None
        self.tp = self.config.backend.tensor_parallel_size
        self.hf_config = load_checked_config(model_path, convert.check_supported, self.tp)
        cpu.apply()
        self.layout = parallelize.initialize(self.tp, self.rank, self.world_size)
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp_size
        self.loss_scale = 1.0  # gradients are summed over the data-parallel ranks (parallelize.py), not averaged
        self.vocab_size = self.hf_config.vocab_size
        self.padded_vocab = padded_vocab(self.vocab_size, self.tp)  # vocab-parallel layers split evenly
        self.model_config = self._model_config(self.hf_config)
        self.adapter = convert.state_dict_adapter(self.model_config, self.hf_config.model_type)
        hf_state = read_hf_state(model_path)
        self.model_path = str(model_path)
        self.model = self._build(
            hf_state, adapter_kwargs=None if self.config.lora is None else self.config.lora.peft_kwargs()
        )
        self.optimizer = adamw(self.model, self.config)
        if self.config.needs_reference and self.config.reference_is_base:  # LoRA: the base under the adapter
            self.reference = lora.AdapterOff(self.model)
        elif self.config.needs_reference:  # the KL reference (the checkpoint) or distill's teacher (its own folder)
            self.reference = self._build_frozen(self.config.teacher, hf_state).eval().requires_grad_(False)

    def _model_config(self, hf_config: Any) -> Any:
        """torchtitan's model config of `hf_config` over the padded vocabulary, with its TP plan (what torchtitan's
        trainer sets in update_from_config)."""
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        model_config = convert.model_config(hf_config, self.padded_vocab)
        set_qwen3_sharding_config(model_config, enable_sp=False, enable_ep=False)
        return model_config

    def _build(
        self,
        hf_state: dict[str, torch.Tensor],
        model_config: Any = None,
        adapter: Any = None,
        adapter_kwargs: dict[str, Any] | None = None,
    ) -> torch.nn.Module:
        """The model of `model_config` with `hf_state`'s weights; with `adapter_kwargs` (train.lora's PEFT
        arguments) a LoRA adapter on it, at its start."""
        model_config = self.model_config if model_config is None else model_config
        inject = None if adapter_kwargs is None else (lambda model: convert.inject_lora(model, adapter_kwargs))
        model = parallelize.build(model_config, self.layout, self.device, self.config.precision, inject)
        state = self.from_hf(hf_state, adapter)
        if adapter_kwargs is not None:
            state = convert.with_lora(model, state)
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
        return model

    def _build_frozen(self, teacher: str | None, hf_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """The checkpoint again (the KL reference), or the teacher from its folder with its own shape (the same
        vocabulary, padded alike), laid out over the same ranks."""
        if teacher is None:
            return self._build(hf_state)
        teacher_config = load_checked_config(teacher, convert.check_supported, self.tp)
        model_config = self._model_config(teacher_config)
        adapter = convert.state_dict_adapter(model_config, teacher_config.model_type)
        return self._build(read_hf_state(teacher), model_config, adapter)

    def from_hf(self, hf_state: dict[str, torch.Tensor], adapter: Any = None) -> dict[str, torch.Tensor]:
        padded = {name: pad_rows(t, self.padded_vocab) if name in _VOCAB_ROWS else t for name, t in hf_state.items()}
        return (self.adapter if adapter is None else adapter).from_hf(padded)

    def _to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (a tied head is the embedding: the adapter leaves it out, as miles_sync's
        naming rule does); with `train.lora`, the merged weights."""
        if self.config.lora is not None:
            state = lora.merged(state, lora.scaling_of(self.config.lora.peft_kwargs()), prefix="")
        hf = self.adapter.to_hf(state)
        return {name: t[: self.vocab_size] if name in _VOCAB_ROWS else t for name, t in hf.items()}

    # ---- the protocol -------------------------------------------------------------------------
    def logits(self, model: torch.nn.Module, c: Collated) -> torch.Tensor:
        logits = model(c.input_ids)  # causal attention; right padding never reaches a real token
        return full_tensor(logits)[..., : self.vocab_size]

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def replicas(self, param: torch.Tensor) -> int:
        return dtensor_replicas(param, self.world_size)

    def export_weights(self, adapter_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
        return export_full(self, adapter_only)

    def export_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Its layout is not HF rows: rank 0 sends every tensor, gathered as `export_weights` does."""
        return self.export_weights(False)

    def save(self, directory: str | Path, step: int) -> None:
        save_full(self, directory, self._state(step))

    def load(self, directory: str | Path) -> int:
        return load_full(self, directory, self._state(0), ("padded_vocab",))

    def shutdown(self) -> None:
        """torchtitan's device mesh goes with the default group, which the trainer closes."""

    def step_optimizer(self) -> float | None:
        max_norm = self.config.optimizer.max_grad_norm or float("inf")  # inf: the norm, measured, nothing clipped
        norm = float(full_tensor(parallelize.clip_grad_norm(list(self.model.parameters()), max_norm)))
        self.optimizer.step()
        return norm

    def dp_group(self):
        return parallelize.data_parallel_group(self.layout, self.tp)

    # ---- full state (backends/common.py) -------------------------------------------------------
    def hf_state(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (collective); meaningful on rank 0."""
        state = full_state(self.model)
        return self._to_hf(state) if self.rank == 0 else {}

    def adapter_params(self) -> dict[str, torch.nn.Parameter]:
        params = dict(self.model.named_parameters())
        return {wire: params[name] for name, wire in convert.lora_wire_names(self.model).items()}

    def _state(self, step: int) -> TrainerState:
        return TrainerState(self.name, step, self.world_size, self.tp, self.padded_vocab)
