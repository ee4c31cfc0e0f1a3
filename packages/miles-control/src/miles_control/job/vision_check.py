"""What a job with a vision-language model, or with images in its data, is checked for before any actor starts
(`preflight.check_job` calls it): images need a model that reads them, and the parts of Miles that do not carry
images yet refuse them, naming the field to change."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_sync.vision import is_vision_language


def check_vision(spec: Any, hf_config: Any, model_path: Path, prompts: Sequence) -> None:
    """Raise `JobCheckError` for images a job cannot use, or a vision-language model used where Miles does not
    carry images yet. (The engine's and the backend's refusals of a family are `check_model`'s.)"""
    from miles_control.job.preflight import JobCheckError

    vision = is_vision_language(hf_config)
    number = next((i for i, r in enumerate(prompts, start=1) if r.images), None)
    if number is not None and not vision:
        raise JobCheckError(
            f"data.image_key: prompt {number} has images (column {spec.data.image_key!r}), but model {model_path} "
            "is a text model (its config.json has no vision_config); use a vision-language model, or name another "
            "column"
        )
    if not vision:
        return
    if spec.train.lora is not None:
        raise JobCheckError(
            f"train.lora: adapters are not carried for vision-language models yet (model_type "
            f"{hf_config.model_type!r}); train the whole model, or freeze the tower with train.freeze"
        )
    if number is not None and spec.rollout.generate not in ("single_turn", "multi_turn"):
        raise JobCheckError(
            f"rollout.generate: {spec.rollout.generate} does not carry images, and prompt {number} has some; use "
            "single_turn or multi_turn"
        )
    if number is not None and getattr(spec.rollout.environment, "type", None) is not None:
        raise JobCheckError(
            f"rollout.environment: a {spec.rollout.environment.type} environment's episodes do not carry images yet, "
            f"and prompt {number} has some"
        )
    ranks = spec.train.backend.world_size
    text_rows = next((i for i, r in enumerate(prompts, start=1) if not r.images), None)
    tower_frozen = any(fnmatch.fnmatchcase("model.visual.patch_embed.proj.weight", p) for p in spec.train.freeze)
    if ranks > 1 and text_rows is not None and not tower_frozen:
        # a rank whose rows have no image computes no gradient for the tower, and FSDP2 reduces the gradients of a
        # group over the parameters that have one: the ranks would disagree
        raise JobCheckError(
            f"train.freeze: with {ranks} trainer ranks the vision tower trains only when every prompt has an image "
            f"(prompt {text_rows} has none); freeze it (train.freeze: ['model.visual.*']) or use one rank"
        )
    if spec.train.critic is not None:
        raise JobCheckError("train.critic: a value model over a vision-language model is not built yet")
