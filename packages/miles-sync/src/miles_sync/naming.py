"""What a published weight version holds: the tensors of an HF checkpoint, named and tied as in one.

One rule for tied embeddings, shared by every trainer's export, every transport and every engine's
receiver and weight check: a model whose config says `tie_word_embeddings` has one tensor for its
input embedding and its output head, published once as `model.embed_tokens.weight`. `lm_head.weight`
is never sent for such a model (as `save_pretrained` leaves it out of the checkpoint), and a receiver
that finds it in a checkpoint folder drops it the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from miles_sync.types import NamedTensor, NamedTensors

TIED_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def without_tied_head(named_tensors: NamedTensors, tied: bool) -> Iterator[NamedTensor]:
    """`named_tensors` minus the head of a tied model (everything, for an untied one)."""
    for name, tensor in named_tensors:
        if tied and name == TIED_HEAD:
            continue
        yield name, tensor


# A LoRA adapter (train.lora, sync.lora: adapter). Inside a PEFT-wrapped model its matrices are named
# `base_model.model.<module>.lora_A.default.weight` (`default`: the adapter's name); on the wire and on disk they
# travel under PEFT's save_pretrained names, the adapter's name dropped (`base_model.model.<module>.lora_A.weight`),
# which is what adapter_model.safetensors holds. Trainer and engine map names with the same two functions.
LORA_ADAPTER_NAME = "default"
_LORA_IN_MODEL = (f".lora_A.{LORA_ADAPTER_NAME}.", f".lora_B.{LORA_ADAPTER_NAME}.")
_LORA_ON_WIRE = (".lora_A.", ".lora_B.")


def is_lora(name: str) -> bool:
    """True for a LoRA adapter matrix, under its in-model or its wire name."""
    return any(part in name for part in _LORA_IN_MODEL + _LORA_ON_WIRE)


def lora_wire_name(param_name: str) -> str:
    """An adapter matrix's in-model name → its wire / save_pretrained name."""
    for inside, outside in zip(_LORA_IN_MODEL, _LORA_ON_WIRE, strict=True):
        if inside in param_name:
            return param_name.replace(inside, outside)
    raise ValueError(f"{param_name} is not a LoRA adapter matrix")


def lora_param_name(wire: str) -> str:
    """A wire / save_pretrained name → the adapter matrix's in-model name."""
    for inside, outside in zip(_LORA_IN_MODEL, _LORA_ON_WIRE, strict=True):
        if outside in wire:
            return wire.replace(outside, inside)
    raise ValueError(f"{wire} is not a LoRA adapter matrix")


# Checkpoint layout. A model may hold some tensors in another layout than its checkpoint: transformers ≥ 5 fuses a
# mixture of experts' per-expert projections (`mlp.experts.<e>.gate_proj.weight`, `up_proj`, `down_proj` on disk)
# into 3-D parameters (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), and `save_pretrained` splits them back.
# A push carries the checkpoint's names and shapes (what SGLang loads, what every backend converts from), so a
# trainer exporting such a model and an engine holding one both need, for every checkpoint tensor, where it lies in
# the model's own tensors.
def checkpoint_views(
    named: dict[str, torch.Tensor], revert: Callable[[dict], dict], kept: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of a model as a view into the model's own tensors `named` (its parameters, or a full
    state dict), by checkpoint name. `revert` maps model-named tensors to checkpoint-named ones (transformers'
    `revert_weight_conversion(model, ·)`, what `save_pretrained` applies); it is run on index tensors, one model
    tensor at a time, so the views are exact whatever the conversion (split, unbind, concatenate) and no weight is
    copied. Writing into a view writes the model's tensor. A model tensor that maps to itself is returned as is.
    `kept`: the names the conversion leaves as they are (`unconverted`), when the caller knows them already.
    ValueError names a checkpoint tensor that is not one contiguous block of one model tensor."""
    views: dict[str, torch.Tensor] = {}
    if kept is None:
        kept = unconverted(named, revert)
    for name, tensor in named.items():
        if name in kept:
            views[name] = tensor  # not converted: the same tensor under the same name
            continue
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: a converted model tensor must be contiguous to be viewed by checkpoint name")
        index_dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
        probe = torch.arange(tensor.numel(), dtype=index_dtype).view(tensor.shape)
        flat = tensor.view(-1)
        for wire, where in revert({name: probe}).items():
            positions = where.reshape(-1)
            start = int(positions[0]) if positions.numel() else 0
            block = torch.arange(start, start + positions.numel(), dtype=index_dtype)
            if not torch.equal(positions, block):
                raise ValueError(
                    f"{wire}: the checkpoint's tensor is not one contiguous block of the model's {name} (the model "
                    "holds it in a layout miles cannot view; its push would need a copy)"
                )
            views[wire] = flat[start : start + positions.numel()].view(where.shape)
    return views


def unconverted(named: dict[str, torch.Tensor], revert: Callable[[dict], dict]) -> set[str]:
    """The names `revert` leaves as they are: one pass over shapes alone (meta tensors), no data touched."""
    return set(revert({name: torch.empty(t.shape, device="meta") for name, t in named.items()})) & set(named)
