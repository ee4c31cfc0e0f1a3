"""Apply FSDP2 to an HF causal LM: one shard group per decoder layer, then the root."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks sharded one group each: the decoder layers (Llama/Qwen2/Mistral families keep them at
    model.model.layers, inside a LoRA wrapper its base model's; a vision-language model at
    model.model.language_model.layers). A vision tower stays in the root's group: it is gathered with the root at
    every forward, on every rank, so a rank whose rows have no image (which does not run the tower) still takes
    part in the same collectives as one whose rows do."""
    from miles_train.lora import base_model

    model = base_model(model)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(getattr(inner, "language_model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"fsdp2: cannot find decoder layers on {type(model).__name__} (expected model.model.layers, or "
            "model.model.language_model.layers)"
        )
    return list(layers)


COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """`precision` (train.precision) is FSDP2's MixedPrecisionPolicy: parameters all-gathered and computed in
    bf16/fp16, gradients reduced in fp32 into the fp32 sharded master weights; fp32 leaves the policy empty."""
    compute = COMPUTE_DTYPES.get(precision)
    policy = (
        MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
