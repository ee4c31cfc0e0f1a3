"""Engine factory: the only place that branches on the engine type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_rollout.config import HFEngineConfig, SGLangEngineConfig
from miles_rollout.protocol import RolloutEngine


def check_model(config: HFEngineConfig | SGLangEngineConfig, hf_config: Any) -> None:
    """Raise ValueError naming the config.json field of `hf_config` the engine cannot serve as configured. The
    hf engine runs whatever transformers builds; SGLang serves what its own model classes hold (its weight check
    derives the layout from the servers for families outside its table: engines/sglang/derived_layout.py)."""
    from miles_sync.vision import family_refusal, is_vision_language

    model_type = getattr(hf_config, "model_type", None)
    refused = family_refusal(hf_config)
    if refused:
        raise ValueError(f"config.json {refused}")
    if config.type == "sglang" and is_vision_language(hf_config):
        raise ValueError(
            f"sglang engine: config.json model_type: {model_type!r} is a vision-language model, and Miles does not "
            "send images to SGLang yet (its requests carry ids only); set rollout.engine.type: hf"
        )
    if config.type == "sglang" and model_type in SGLANG_CPU_REFUSED and not _cuda():
        raise ValueError(
            f"sglang engine: config.json model_type: {model_type!r}: {SGLANG_CPU_REFUSED[model_type]}; use "
            "rollout.engine.type: hf on this machine"
        )


# Families SGLang cannot serve on its CPU path, and why (each tried here: its servers fail to start or to answer).
SGLANG_CPU_REFUSED: dict[str, str] = {
    "qwen2_moe": "SGLang's CPU path runs its mixture of experts through a Triton kernel, and its servers crash at the "
    "first request on a machine without a GPU ('RuntimeError: 0 active drivers')",
    "deepseek_v3": "SGLang's DeepSeek model class reads DeepSeek's own config.json fields (moe_layer_freq, "
    "topk_method, ...) that transformers' DeepseekV3Config does not write, and its latent attention on CPU is "
    "untried here",
}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def build_engine(
    config: HFEngineConfig | SGLangEngineConfig,
    model_path: str | Path,
    seed: int = 0,
    packed: str | None = None,
    gpu_ids: list[list[str]] | None = None,
    lora: dict[str, Any] | None = None,
) -> RolloutEngine:
    """The engine of `config` serving `model_path`. `packed`: the format the pushes carry packed
    (`sync.quant_wire: packed`); the engine then serves a packed copy of the checkpoint (sglang on a GPU only).
    `gpu_ids`: each SGLang server's GPUs, from the resource plan (`miles_control.job.placement`). `lora`: PEFT
    `LoraConfig` keyword arguments of the adapter the pushes carry (`sync.lora: adapter`): the hf engine applies
    it to the base it holds with PEFT, SGLang serves each pushed version by name."""
    if packed is not None and config.type != "sglang":
        raise ValueError(f"sync.quant_wire: packed needs rollout.engine.type: sglang (got {config.type!r})")
    if config.type == "hf":
        from miles_rollout.engines.hf import HFEngine

        if gpu_ids:
            raise ValueError("the hf engine runs on CPU: it takes no GPUs (resources.rollout_gpus_per_engine: 0)")

        return HFEngine(model_path, config, seed=seed, lora=lora)
    if config.type == "sglang":
        from miles_rollout.engines.sglang.engine import SGLangEngine

        return SGLangEngine(model_path, config, seed=seed, packed=packed, gpu_ids=gpu_ids, lora=lora)
    raise ValueError(f"unknown rollout engine {config.type!r}")
