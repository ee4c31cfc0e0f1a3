"""torchtitan trainer backend: a Qwen2/Llama-family torchtitan model parallelised by torchtitan
(`parallelize_qwen3`: TP over `tensor_parallel_size` ranks, FSDP2 over the data-parallel ranks),
HF weights in and out through its state-dict adapter. fp32.

Gradients are summed over data-parallel ranks, as torchtitan does (`disable_fsdp_gradient_division`):
the loss is already the global token mean.
"""

from __future__ import annotations

import logging
import tempfile
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
from miles_train.backends.distributed import pad_rows, padded_vocab
from miles_train.backends.hf_io import read_hf_state
from miles_train.backends.torchtitan import convert, cpu
from miles_train.backends.update import GRPOBackend
from miles_train.collate import Collated
from miles_train.config import TrainConfig

log = logging.getLogger(__name__)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")
_SPMD_BACKEND = "partial_dtensor"  # DTensor TP + FSDP2, torchtitan's long-standing path


class TorchtitanBackend(GRPOBackend):
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
        from torchtitan.config.configs import ParallelismConfig
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.parallel_dims import ParallelDims

        self.parallelism = ParallelismConfig(
            tensor_parallel_degree=self.tp,
            data_parallel_shard_degree=-1,
            enable_sequence_parallel=False,
            spmd_backend=_SPMD_BACKEND,
        )
        dist_utils.set_spmd_backend(_SPMD_BACKEND)
        self.parallel_dims = ParallelDims.from_config(self.parallelism, world_size)
        self.parallel_dims.build_mesh()
        self.dp_size = self.parallel_dims.dp_shard
        self.dp_rank = rank // self.tp  # mesh order: the tp axis is innermost
        self._dist_utils = dist_utils

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
        if config.grpo.kl_coef > 0:
            self.reference = self._build(hf_state).eval().requires_grad_(False)

    def _build(self, hf_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        from torchtitan.config.configs import CompileConfig, TrainingConfig
        from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3

        with torch.device("meta"):
            model = self.model_config.build()
        with tempfile.TemporaryDirectory() as dump_folder:
            parallelize_qwen3(
                model,
                parallel_dims=self.parallel_dims,
                training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
                parallelism=self.parallelism,
                compile_config=CompileConfig(),
                ac_config=None,
                dump_folder=dump_folder,
            )
        disable_fsdp_gradient_division(model)
        cpu.after_parallelize(model)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights(buffer_device=self.device)  # RoPE tables; the weights are replaced next
        set_model_state_dict(model, self._from_hf(hf_state), options=StateDictOptions(full_state_dict=True))
        return model

    def _from_hf(self, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        padded = {name: pad_rows(t, self.padded_vocab) if name in _VOCAB_ROWS else t for name, t in hf_state.items()}
        return self.adapter.from_hf(padded)

    def _to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors (a tied head is the embedding: the adapter leaves it out, as miles_sync's
        naming rule does)."""
        hf = self.adapter.to_hf(state)
        return {name: t[: self.vocab_size] if name in _VOCAB_ROWS else t for name, t in hf.items()}

    # ---- GRPOBackend hooks ---------------------------------------------------------------------
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
            total = self._dist_utils.clip_grad_norm_(list(self.model.parameters()), max_norm)
            norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
        self.optimizer.step()
        return norm

    def _dp_group(self):
        if self.tp == 1:
            return None
        return self.parallel_dims.get_mesh("fsdp").get_group()

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

    def load(self, directory: str | Path) -> None:
        ckpt = load_checkpoint(directory, self._state(), ("padded_vocab",))
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, self._from_hf(ckpt.hf_state), options=full)
        set_optimizer_state_dict(self.model, self.optimizer, ckpt.optimizer_state, options=full)
        self.step = ckpt.state.step
