"""Vision-language models as both sides of the loop load them: which configs are one, which families Miles runs,
and the one rule that keeps a sampled response trainable (the image placeholders are never sampled).

Shared by the engines (miles_rollout) and the trainers (miles_train), so that both load the same model class and
compute logits over the same distribution. Reads configs and registers a hook; imports no transformers.
"""

from __future__ import annotations

from typing import Any

# model_type → what the engines and the fsdp2 trainer were checked with: the processor's `image_grid_thw` and
# `mm_token_type_ids`, 3-D (multimodal) RoPE positions from `get_rope_index`, the offsets kept in `rope_deltas`
VISION_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# the config fields naming a model's image / video placeholder ids (Qwen's `<|image_pad|>`, `<|video_pad|>`)
PLACEHOLDER_FIELDS = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
# the logit a placeholder gets (or the dtype's lowest, fp16's −65504): its probability is 0, and 0 × log p stays
# finite (an entropy)
_SUPPRESSED_LOGIT = -1e9


def is_vision_language(config: Any) -> bool:
    """A model config with a vision tower (`vision_config`): Qwen2.5-VL, Qwen3-VL, Gemma 3, LLaVA..."""
    return getattr(config, "vision_config", None) is not None


def model_class_name(config: Any) -> str:
    """The transformers auto class a config loads with: image-text-to-text for a vision-language model (transformers
    has no causal-LM class for them), else the causal LM."""
    return "AutoModelForImageTextToText" if is_vision_language(config) else "AutoModelForCausalLM"


def placeholder_ids(config: Any) -> list[int]:
    """The ids that stand for an image's (or a video's) features in a prompt. A response that held one could not be
    trained on (the model would look for features it was never given), so neither engine samples them."""
    if not is_vision_language(config):
        return []
    found = {getattr(config, name, None) for name in PLACEHOLDER_FIELDS}
    return sorted(i for i in found if isinstance(i, int))


def suppress_placeholders(model: Any) -> list[int]:
    """Give the image placeholders a logit of −1e9 at the model's output (a forward hook on the output embeddings),
    in the engine that samples and in the trainer that recomputes logprobs: both see one distribution, over the
    other tokens. Returns the ids suppressed (none for a text model, and then no hook)."""
    import torch

    ids = placeholder_ids(model.config)
    head = model.get_output_embeddings() if ids else None
    if head is None:
        return []
    index = torch.tensor(ids, dtype=torch.long)

    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        lowest = max(_SUPPRESSED_LOGIT, torch.finfo(output.dtype).min)
        return output.index_fill(-1, index.to(output.device), lowest)

    head.register_forward_hook(hook)
    return ids


def family_refusal(config: Any) -> str | None:
    """Why Miles cannot run this vision-language model (None when it can, or for a text model)."""
    if not is_vision_language(config):
        return None
    family = getattr(config, "model_type", "?")
    if family in VISION_FAMILIES:
        return None
    return (
        f"model_type {family!r} is a vision-language model Miles has not been checked with (it runs "
        f"{', '.join(VISION_FAMILIES)}: their processor's image grids and 3-D RoPE positions)"
    )


def batch_inputs(rows: list[dict[str, Any] | None], starts: list[int], width: int) -> dict[str, Any]:
    """A padded batch's image inputs, for the model's forward (empty when no row has images): each processor tensor
    of the rows that have images, concatenated in row order (the model takes the features of a batch's placeholders
    in that order), and `mm_token_type_ids` [rows, width], each row's entries (one per prompt id) placed from
    `starts[row]` (left padding: width − the row's length; right padding: 0) and 0 elsewhere (text, padding, a
    response). The engine and the trainer build their batches with it."""
    import torch

    if not any(rows):
        return {}
    types = torch.zeros((len(rows), width), dtype=torch.long)
    tensors: dict[str, list[torch.Tensor]] = {}
    for row, inputs in enumerate(rows):
        if not inputs:
            continue
        kinds = torch.as_tensor(inputs["mm_token_type_ids"], dtype=torch.long)
        types[row, starts[row] : starts[row] + len(kinds)] = kinds
        for key, value in inputs.items():
            if key != "mm_token_type_ids":
                tensors.setdefault(key, []).append(torch.as_tensor(value))
    return {"mm_token_type_ids": types} | {key: torch.cat(values) for key, values in tensors.items()}
