"""torchtitan trainer backend: a Qwen2/Llama-family torchtitan model parallelised by torchtitan
(`parallelize.py`: TP over `tensor_parallel_size` ranks, FSDP2 over the data-parallel ranks), HF weights in
and out through its state-dict adapter (`convert.py`). fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from miles_train.backends.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from miles_train.backends.distributed import pad_rows, padded_vocab
from miles_train.backends.hf_io import read_hf_state
from miles_train.backends.torchtitan import convert, cpu, parallelize
from miles_train.backends.update import TrainerBase
from miles_train.collate import Collated
from miles_train.config import TrainConfig

log = logging.getLogger(__name__)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


class TorchtitanBackend(TrainerBase):
    name = "torchtitan"

    def __init__(
        self,
        config: TrainConfig,
        model_path: str | Path,
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
    ) -> None:
        from transformers import AutoConfig

        super().__init__(config, rank, world_size, init_method)
        backend = config.backend
        self.tp = backend.tensor_parallel_size
        self.hf_config = AutoConfig.from_pretrained(str(model_path))
        convert.check_supported(self.hf_config, self.tp)
        self.pad_token_id = self.hf_config.pad_token_id or 0

        cpu.apply()
        self.layout = parallelize.initialize(self.tp, rank, world_size)
        self.dp_rank, self.dp_size = self.layout.dp_rank, self.layout.dp_size

        self.vocab_size = self.hf_config.vocab_size
        self.padded_vocab = padded_vocab(self.vocab_size, self.tp)  # vocab-parallel layers split evenly
        self.model_config = convert.model_config(self.hf_config, self.padded_vocab)
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        # torchtitan's TP plan lives on the model config (what its trainer sets in update_from_config)
        set_qwen3_sharding_config(self.model_config, enable_sp=False, enable_ep=False)
        self.adapter = convert.state_dict_adapter(self.model_config)
        hf_state = read_hf_state(model_path)
        self.model = self._build(hf_state)
        self.model.train()
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
        )
        if config.needs_reference:  # the KL reference (the checkpoint) or distill's teacher (its own folder)
            self.reference = self._build_frozen(config.teacher, hf_state).eval().requires_grad_(False)
        self._init_side_models(model_path)  # ppo's critic, distill's teacher record

    def _build(
        self, hf_state: dict[str, torch.Tensor], model_config: Any = None, adapter: Any = None
    ) -> torch.nn.Module:
        model_config = self.model_config if model_config is None else model_config
        model = parallelize.build(model_config, self.layout, self.device, self.config.precision)
        state = self._from_hf(hf_state, adapter)
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
        return model

    def _build_frozen(self, teacher: str | None, hf_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """The checkpoint again (the KL reference), or the teacher from its folder with its own shape (the same
        vocabulary, padded alike), laid out over the same ranks."""
        if teacher is None:
            return self._build(hf_state)
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config
        from transformers import AutoConfig

        teacher_config = AutoConfig.from_pretrained(teacher)
        convert.check_supported(teacher_config, self.tp)
        model_config = convert.model_config(teacher_config, self.padded_vocab)
        set_qwen3_sharding_config(model_config, enable_sp=False, enable_ep=False)
        return self._build(read_hf_state(teacher), model_config, convert.state_dict_adapter(model_config))

    def _from_hf(self, hf_state: dict[str, torch.Tensor], adapter: Any = None) -> dict[str, torch.Tensor]:
        padded = {name: pad_rows(t, self.padded_vocab) if name in _VOCAB_ROWS else t for name, t in hf_state.items()}
        return (self.adapter if adapter is None else adapter).from_hf(padded)

    def _to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (a tied head is the embedding: the adapter leaves it out, as miles_sync's
        naming rule does)."""
        hf = self.adapter.to_hf(state)
        return {name: t[: self.vocab_size] if name in _VOCAB_ROWS else t for name, t in hf.items()}

    # ---- TrainerBase hooks ---------------------------------------------------------------------
    def _logits(self, model: torch.nn.Module, c: Collated) -> torch.Tensor:
        logits = model(c.input_ids)  # causal attention; right padding never reaches a real token
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        return logits[..., : self.vocab_size]

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _step_optimizer(self) -> float | None:
        norm = None
        max_norm = self.config.optimizer.max_grad_norm
        if max_norm is not None:
            total = parallelize.clip_grad_norm(list(self.model.parameters()), max_norm)
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        self.optimizer.step()
        return norm

    def _dp_group(self):
        return parallelize.data_parallel_group(self.layout, self.tp)

    # ---- weights, checkpoints -------------------------------------------------------------------
    def _hf_state(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors (collective); meaningful on rank 0."""
        state = get_model_state_dict(self.model, options=_FULL)
        return self._to_hf(state) if self.rank == 0 else {}

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        state = self._hf_state()
        if self.rank == 0:
            yield from state.items()

    def _state(self) -> TrainerState:
        return TrainerState(self.name, self.step, self.world_size, self.tp, self.padded_vocab)

    def save(self, directory: str | Path) -> None:
        """The common checkpoint (backends/checkpoint.py) with the full optimizer state, whose vocabulary rows
        are padded for this tensor-parallel size."""
        weights = self._hf_state()
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)
        save_checkpoint(directory, self.rank, self.hf_config, weights, self._state(), optim_state)
        self._save_side_models(directory)

    def load(self, directory: str | Path) -> None:
        ckpt = load_checkpoint(directory, self._state(), ("padded_vocab",))
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, self._from_hf(ckpt.hf_state), options=full)
        set_optimizer_state_dict(self.model, self.optimizer, ckpt.optimizer_state, options=full)
        self.step = ckpt.state.step
        self._load_side_models(directory)
