"""Megatron's parallel layout: model-parallel groups, the model built on this rank's tensor-parallel shard, and
Megatron's DistributedDataParallel around it.

Ranks form `world_size / tensor_parallel_size` data-parallel groups of `tensor_parallel_size` ranks each
(Megatron's order: consecutive ranks share a layer). A mixture of experts splits its experts over
`expert_parallel_size` consecutive ranks: each holds whole experts, and Megatron's token dispatcher sends every token
to the ranks of its experts (the data-parallel ranks then hold different experts; everything else is replicated).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles_train.backends.megatron import convert


@dataclass(frozen=True)
class Layout:
    """This rank's place in the tensor-parallel × data-parallel grid."""

    tp_rank: int
    tp_group: Any
    dp_rank: int
    dp_size: int
    ep_rank: int = 0
    ep_group: Any = None


def initialize(tp: int, ep: int = 1) -> Layout:
    """Megatron's model-parallel groups over the default process group (once per process)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, create_gloo_process_groups=False
        )
    return Layout(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
    )


def destroy() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def data_parallel_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def build(
    hf_config: Any,
    hf_state: dict[str, torch.Tensor],
    tp: int,
    tp_rank: int,
    device: torch.device,
    transformer_config: Any = None,
    ep: int = 1,
    ep_rank: int = 0,
):
    """The GPTModel of `hf_config` holding this rank's shard of `hf_state` (and its experts). When
    `transformer_config` asks for bf16 or fp16, Megatron's Float16Module wraps it: parameters in that dtype, inputs
    cast in, logits out in fp32 (the fp32 master weights live in Megatron's mixed-precision optimizer)."""
    model = convert.build_gpt_model(hf_config, tp, ep=ep)
    assign(model, convert.hf_to_megatron(hf_state, hf_config, tp, tp_rank, ep, ep_rank))
    model = model.to(device)
    if transformer_config is not None and (transformer_config.bf16 or transformer_config.fp16):
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(transformer_config, model)
    return model


def local_name(name: str) -> str:
    """A parameter's name inside the GPTModel, without the wrappers' `module.` prefixes (DDP, Float16Module)."""
    while name.startswith("module."):
        name = name.removeprefix("module.")
    return name


def assign(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` (Megatron names, this rank's shard) into `model`; every name and shape must match."""
    params = {local_name(name): p for name, p in model.named_parameters()}
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise RuntimeError(f"megatron: weight names do not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != tensors[name].shape:
                raise RuntimeError(
                    f"megatron: {name} has shape {tuple(param.shape)}, checkpoint {tuple(tensors[name].shape)}"
                )
            param.copy_(tensors[name])


def wrap_ddp(transformer_config: Any, model: torch.nn.Module) -> torch.nn.Module:
    """Megatron's DistributedDataParallel: fp32 gradient buffers averaged over the data-parallel ranks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    return DistributedDataParallel(transformer_config, config, model)
