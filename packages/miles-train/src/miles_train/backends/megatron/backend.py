"""megatron-core trainer backend: GPTModel (local layer spec) from an HF Qwen2/Qwen3/Llama checkpoint or a mixture of
experts (Qwen3-MoE, Mixtral: megatron's MoELayer), tensor parallel × data parallel, experts over expert-parallel ranks
(`parallelize.py`), Megatron's optimizer, HF weights out (`convert.py`).
`train.precision` bf16/fp16 uses Megatron's mechanism: Float16Module parameters, fp32 gradient buffers and the
mixed-precision optimizer's fp32 master weights (with its dynamic loss scaler for fp16).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from miles_train.backends.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from miles_train.backends.hf_family import load_checked_config
from miles_train.backends.hf_io import read_hf_state
from miles_train.backends.megatron import convert, cpu, parallelize
from miles_train.collate import Collated
from miles_train.protocol import Rank

log = logging.getLogger(__name__)


# max_grad_norm None: a bound no norm reaches, so Megatron's optimizer still measures the norm (with clip_grad 0 it
# reports 0.0) and never scales a gradient.
UNCLIPPED = 1e30


class MegatronBackend:
    """One rank of a megatron-core GPTModel: tensor parallel × data parallel, experts over expert-parallel ranks (a
    `miles_train.protocol.Backend`)."""

    name = "megatron"

    def __init__(self, where: Rank, model_path: str | Path) -> None:
        self.config, self.rank, self.world_size, self.device = where.config, where.rank, where.world_size, where.device
        self.overflow_skips = 0
        self.reference: torch.nn.Module | None = None
        self.tp = self.config.backend.tensor_parallel_size
        self.ep = self.config.backend.expert_parallel_size
        self.hf_config = load_checked_config(
            model_path, lambda hf_config, tp: convert.check_supported(hf_config, tp, self.ep), self.tp
        )
        self.pad_token_id = self.hf_config.pad_token_id or 0
        cpu.apply()
        layout = parallelize.initialize(self.tp, self.ep)
        self.tp_rank, self.tp_group = layout.tp_rank, layout.tp_group
        self.dp_rank, self.dp_size = layout.dp_rank, layout.dp_size
        self.ep_rank, self.ep_group = layout.ep_rank, layout.ep_group
        # Megatron's DDP averages gradients over the data-parallel ranks: × dp_size restores the
        # global token mean of the loss.
        self.loss_scale = float(self.dp_size)
        self._init_rng()

        hf_state = read_hf_state(model_path)
        self.transformer_config = convert.transformer_config(self.hf_config, self.tp, self.config.precision, self.ep)
        model = self._build(self.hf_config, hf_state, self.transformer_config)
        self.model = parallelize.wrap_ddp(self.transformer_config, model)
        self.optimizer = self._build_optimizer()
        if self.config.needs_reference:  # the KL reference (the checkpoint) or distill's teacher (its own folder)
            self.reference = self._build_frozen(self.config.teacher, hf_state).eval().requires_grad_(False)

    # ---- construction --------------------------------------------------------------------------
    def _build(self, hf_config, hf_state: dict[str, torch.Tensor], transformer_config) -> torch.nn.Module:
        return parallelize.build(
            hf_config, hf_state, self.tp, self.tp_rank, self.device, transformer_config, self.ep, self.ep_rank
        )

    def _build_frozen(self, teacher: str | None, hf_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """The checkpoint again (the KL reference), or the teacher from its folder with its own shape, split over
        the same tensor-parallel ranks."""
        if teacher is None:
            return self._build(self.hf_config, hf_state, self.transformer_config)
        teacher_config = load_checked_config(
            teacher, lambda hf_config, tp: convert.check_supported(hf_config, tp, self.ep), self.tp
        )
        transformer_config = convert.transformer_config(teacher_config, self.tp, self.config.precision, self.ep)
        return self._build(teacher_config, read_hf_state(teacher), transformer_config)

    def _init_rng(self) -> None:
        from megatron.core import tensor_parallel

        if not cpu.init_rng_tracker():
            # Megatron's tracker (per-TP-rank CUDA generators); dropout is off, so the seed is inert
            tensor_parallel.model_parallel_cuda_manual_seed(1234)

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        opt = self.config.optimizer
        with cpu.on_cpu():
            return get_megatron_optimizer(
                MegatronOptimizerConfig(
                    optimizer="adam",
                    lr=opt.lr,
                    adam_beta1=opt.betas[0],
                    adam_beta2=opt.betas[1],
                    adam_eps=opt.eps,
                    weight_decay=opt.weight_decay,
                    clip_grad=opt.max_grad_norm or UNCLIPPED,
                    params_dtype=torch.float32,
                    bf16=self.config.precision == "bf16",
                    fp16=self.config.precision == "fp16",
                    loss_scale=None,  # fp16: Megatron's dynamic loss scaler
                    initial_loss_scale=2.0**16,
                ),
                [self.model],
                use_gloo_process_groups=False,
            )

    # ---- the protocol -------------------------------------------------------------------------
    def logits(self, model: torch.nn.Module, c: Collated) -> torch.Tensor:
        ids = c.input_ids
        rows, seq = ids.shape
        if self.ep > 1:
            # Megatron's all-gather token dispatcher gathers every expert-parallel rank's tokens into one tensor, which
            # needs the same shape on each: pad to the group's largest (padding rows and columns are sliced off).
            shape = torch.tensor([rows, seq], device=ids.device)
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.ep_group)
            width, height = int(shape[1]) - seq, int(shape[0]) - rows
            ids = torch.nn.functional.pad(ids, (0, width, 0, height), value=self.pad_token_id)
            seq = ids.shape[1]
        position_ids = torch.arange(seq, device=ids.device)[None].expand_as(ids)
        # Right padding: with a causal mask no real token attends to padding. The mask is passed
        # (True = masked) because the local attention's default causal mask is built on "cuda";
        # an s × s boolean per forward costs nothing next to the attention itself.
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=ids.device), 1)[None, None]
        logits = model(ids, position_ids, causal, runtime_gather_output=True)
        return logits[:rows, : c.input_ids.shape[1], : self.hf_config.vocab_size]

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        if self.config.precision == "fp16":  # the mixed-precision optimizer's loss scale; it unscales in step()
            with cpu.on_cpu():
                loss = self.optimizer.scale_loss(loss)
        loss.backward()

    def step_optimizer(self) -> float | None:
        from megatron.core.distributed import finalize_model_grads

        # Megatron's own gradient finalisation: the data-parallel reduction, and the sum over the TP group of
        # the replicated weights whose inputs are split by head (Qwen3's q/k layernorms).
        with cpu.on_cpu():
            finalize_model_grads([self.model])
        with cpu.on_cpu():
            ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            if self.config.precision != "fp16":
                raise RuntimeError("megatron: the optimizer skipped the step (non-finite gradients)")
            self.overflow_skips += 1  # the loss scaler backs off; the step is skipped
            return None
        return float(grad_norm) if grad_norm is not None else None

    def dp_group(self):
        return parallelize.data_parallel_group()

    def replicas(self, param: torch.Tensor) -> int:
        """Data-parallel ranks all hold every parameter but an expert's (`allreduce` False: one rank of each
        expert-parallel group); TP ranks split some (`tensor_model_parallel`)."""
        if not getattr(param, "allreduce", True):
            return self.world_size // self.ep
        return self.dp_size * (1 if getattr(param, "tensor_model_parallel", False) else self.tp)

    # ---- weights, checkpoints -------------------------------------------------------------------
    def _local_params(self) -> dict[str, torch.Tensor]:
        return {parallelize.local_name(name): p for name, p in self.model.named_parameters()}

    def export_weights(self, adapter_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """All-gather each parameter over the tensor-parallel group (an expert's over the expert-parallel group, under
        its index in the whole layer), convert to HF on global rank 0. (No adapter: the job spec refuses train.lora
        on megatron.)"""
        assert not adapter_only, "megatron: train.lora is refused by the spec"
        shards: dict[str, list[torch.Tensor]] = {}
        local_experts = convert.num_experts(self.hf_config) // self.ep
        for name, param in self._local_params().items():
            data = param.detach()
            if convert.is_expert(name):
                parts = [data]
                if self.ep > 1:
                    parts = [torch.empty_like(data) for _ in range(self.ep)]
                    dist.all_gather(parts, data.contiguous(), group=self.ep_group)
                for ep_rank, part in enumerate(parts):
                    shards[convert.global_expert_name(name, ep_rank, local_experts)] = [part.cpu()]
                continue
            if self.tp > 1:
                parts = [torch.empty_like(data) for _ in range(self.tp)]
                dist.all_gather(parts, data.contiguous(), group=self.tp_group)
            else:
                parts = [data]
            shards[name] = [p.cpu() for p in parts]
        if self.rank == 0:
            yield from convert.megatron_to_hf(shards, self.hf_config)

    def export_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Its layout is not HF rows: rank 0 sends every tensor, gathered as `export_weights` does."""
        return self.export_weights()

    def _state(self, step: int) -> TrainerState:
        return TrainerState(self.name, step, self.world_size, self.tp, expert_parallel_size=self.ep)

    def save(self, directory: str | Path, step: int) -> None:
        """The common checkpoint (backends/checkpoint.py) with each rank's optimizer state (Megatron's layout:
        loadable on the same world_size and tensor_parallel_size)."""
        weights = {name: t.contiguous() for name, t in self.export_weights()}
        with cpu.on_cpu():
            optimizer_state = self.optimizer.state_dict()
        save_checkpoint(
            directory, self.rank, self.hf_config, weights, self._state(step), optimizer_state,
            per_rank_optimizer=True, optimizer_io=cpu.on_cpu,
        )  # fmt: skip

    def load(self, directory: str | Path) -> int:
        ckpt = load_checkpoint(
            directory, self._state(0), ("world_size", "tensor_parallel_size", "expert_parallel_size"), self.rank,
            per_rank_optimizer=True, optimizer_io=cpu.on_cpu,
        )  # fmt: skip
        parallelize.assign(
            self.model,
            convert.hf_to_megatron(ckpt.hf_state, self.hf_config, self.tp, self.tp_rank, self.ep, self.ep_rank),
        )
        with cpu.on_cpu():
            self.optimizer.load_state_dict(ckpt.optimizer_state)
        return ckpt.state.step

    def shutdown(self) -> None:
        parallelize.destroy()
