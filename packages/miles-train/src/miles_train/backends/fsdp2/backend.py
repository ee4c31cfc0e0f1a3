"""FSDP2 trainer backend: HF model, `fully_shard` per layer, gloo on CPU / NCCL on GPU, GRPO loss."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoModelForCausalLM

from miles_sync import without_tied_head
from miles_train.backends.common import GRPOBackend, save_hf_weights, with_tied_head
from miles_train.backends.fsdp2.parallelize import apply_fsdp
from miles_train.collate import Collated
from miles_train.config import TrainConfig

log = logging.getLogger(__name__)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FSDP2Backend(GRPOBackend):
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
        if config.grpo.kl_coef > 0:
            self.reference = self._load(model_path).eval().requires_grad_(False)

    def _load(self, model_path: str | Path) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(self.device)
        return apply_fsdp(model, self.config.backend.mixed_precision)

    def _logits(self, model: torch.nn.Module, c: Collated) -> torch.Tensor:
        return model(input_ids=c.input_ids, attention_mask=c.attention_mask).logits

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _step_optimizer(self) -> float | None:
        norm = None
        if self.config.optimizer.max_grad_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optimizer.max_grad_norm)
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        self.optimizer.step()
        return norm

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors: a tied head is the embedding, exported once (miles_sync.naming)."""
        state = get_model_state_dict(self.model, options=_FULL)
        if self.rank == 0:
            yield from without_tied_head(state.items(), bool(getattr(self.model.config, "tie_word_embeddings", False)))

    def save(self, directory: str | Path) -> None:
        """A checkpoint is an HF folder (config + model.safetensors) plus optimizer state."""
        directory = Path(directory)
        model_state = get_model_state_dict(self.model, options=_FULL)
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=_FULL)
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            save_hf_weights(directory, self.model.config, model_state)
            torch.save(optim_state, directory / "optimizer.pt")
            (directory / "trainer_state.json").write_text(json.dumps({"step": self.step, "backend": self.name}))
        dist.barrier()

    def load(self, directory: str | Path) -> None:
        from safetensors.torch import load_file

        directory = Path(directory)
        written_by = json.loads((directory / "trainer_state.json").read_text()).get("backend")
        if written_by != self.name:
            raise ValueError(f"fsdp2: checkpoint {directory} was written by the {written_by} backend")
        model_state = with_tied_head(self.model.config, load_file(str(directory / "model.safetensors")))
        set_model_state_dict(self.model, model_state, options=StateDictOptions(full_state_dict=True))
        optim_state = torch.load(directory / "optimizer.pt", weights_only=False)
        set_optimizer_state_dict(
            self.model, self.optimizer, optim_state, options=StateDictOptions(full_state_dict=True)
        )
        self.step = json.loads((directory / "trainer_state.json").read_text())["step"]
