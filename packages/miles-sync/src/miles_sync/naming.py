"""What a published weight version holds: the tensors of an HF checkpoint, named and tied as in one.

One rule for tied embeddings, shared by every trainer's export, every transport and every engine's
receiver and weight check: a model whose config says `tie_word_embeddings` has one tensor for its
input embedding and its output head, published once as `model.embed_tokens.weight`. `lm_head.weight`
is never sent for such a model (as `save_pretrained` leaves it out of the checkpoint), and a receiver
that finds it in a checkpoint folder drops it the same way.
"""

from __future__ import annotations

from collections.abc import Iterator

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
