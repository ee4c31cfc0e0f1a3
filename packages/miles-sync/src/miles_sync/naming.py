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
