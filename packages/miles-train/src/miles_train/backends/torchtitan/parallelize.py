"""torchtitan's parallel layout: the device mesh (TP innermost, FSDP2 over the data-parallel ranks) and the
model built on the meta device, parallelised by torchtitan's own `parallelize_qwen3`, then materialised.

Gradients are summed over data-parallel ranks, as torchtitan does (`disable_fsdp_gradient_division`): the
loss is already the global token mean.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from miles_train.backends.torchtitan import cpu

SPMD_BACKEND = "partial_dtensor"  # DTensor TP + FSDP2, torchtitan's long-standing path


@dataclass(frozen=True)
class Layout:
    """torchtitan's parallelism settings and the mesh they built, and this rank's data-parallel place."""

    parallelism: Any
    parallel_dims: Any
    dp_rank: int
    dp_size: int


def initialize(tp: int, rank: int, world_size: int) -> Layout:
    """The device mesh of `world_size` ranks: tensor parallel over `tp`, FSDP2 over the rest."""
    from torchtitan.config.configs import ParallelismConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    parallelism = ParallelismConfig(
        tensor_parallel_degree=tp,
        data_parallel_shard_degree=-1,
        enable_sequence_parallel=False,
        spmd_backend=SPMD_BACKEND,
    )
    dist_utils.set_spmd_backend(SPMD_BACKEND)
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    return Layout(parallelism, dims, dp_rank=rank // tp, dp_size=dims.dp_shard)  # mesh order: tp innermost


def data_parallel_group(layout: Layout, tp: int) -> Any:
    """The group gradients are reduced over when TP splits the world (None: the default group)."""
    return None if tp == 1 else layout.parallel_dims.get_mesh("fsdp").get_group()


PARAM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # torchtitan's mixed_precision_param offers these two


def build(
    model_config: Any,
    layout: Layout,
    device: torch.device,
    precision: str = "fp32",
    before_parallelize: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> torch.nn.Module:
    """The model of `model_config`, parallelised and materialised on `device` (weights uninitialised but for
    the RoPE tables: the caller loads the checkpoint). `precision` (train.precision) is torchtitan's
    `mixed_precision_param`: FSDP2 gathers and computes in it; gradients reduce in fp32 into fp32 shards.
    `before_parallelize` changes the model built on the meta device first (`train.lora` injects its adapter)."""
    from torchtitan.config.configs import CompileConfig, TrainingConfig
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    with torch.device("meta"):
        model = model_config.build()
        if before_parallelize is not None:
            model = before_parallelize(model)
    with tempfile.TemporaryDirectory() as dump_folder:
        parallelize_qwen3(
            model,
            parallel_dims=layout.parallel_dims,
            training=TrainingConfig(
                mixed_precision_param=PARAM_DTYPES[precision],  # type: ignore[arg-type]
                mixed_precision_reduce="float32",
            ),
            parallelism=layout.parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder=dump_folder,
        )
    disable_fsdp_gradient_division(model)
    cpu.after_parallelize(model)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)  # RoPE tables; the weights are replaced next
    return model


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torchtitan's gradient clipping (DTensor-aware: the norm spans every shard)."""
    from torchtitan.distributed import utils as dist_utils

    return dist_utils.clip_grad_norm_(parameters, max_norm)
