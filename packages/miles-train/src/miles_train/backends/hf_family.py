"""The HF model families the megatron and torchtitan backends rebuild (Qwen2, Llama), and what of
their configs those rebuilds cover. Anything else gets an error that names the setting, rather
than a model that silently drops weights."""

from __future__ import annotations

from typing import Any

SUPPORTED = ("qwen2", "llama")


def rope_parameters(hf_config: Any) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" not in params and hasattr(hf_config, "rope_theta"):  # transformers 4.x
        params = {"rope_theta": hf_config.rope_theta, **(getattr(hf_config, "rope_scaling", None) or {})}
    return params


def head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def has_qkv_bias(hf_config: Any) -> bool:
    """Qwen2 has biases on q, k and v (and nowhere else)."""
    return hf_config.model_type == "qwen2"


def check_family(hf_config: Any, backend: str) -> None:
    """Raise ValueError naming the first setting of `hf_config` the rebuilt model would not honour."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"{backend} backend: model_type {model_type!r} is not supported (one of {SUPPORTED})")
    unsupported = {
        "attention_bias": bool(getattr(hf_config, "attention_bias", False)) and model_type == "llama",
        "mlp_bias": bool(getattr(hf_config, "mlp_bias", False)),
        "use_sliding_window": bool(getattr(hf_config, "use_sliding_window", False)),
        "hidden_act": getattr(hf_config, "hidden_act", "silu") != "silu",
        "rope scaling": rope_parameters(hf_config).get("rope_type", "default") not in (None, "default"),
    }
    for setting, present in unsupported.items():
        if present:
            raise ValueError(f"{backend} backend: {model_type} with {setting} is not supported")
    if hf_config.num_attention_heads % hf_config.num_key_value_heads:
        raise ValueError(f"{backend} backend: num_attention_heads must be a multiple of num_key_value_heads")


def check_divides(hf_config: Any, backend: str, tp: int, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(hf_config, name) % tp:
            raise ValueError(
                f"{backend} backend: tensor_parallel_size {tp} must divide {name} ({getattr(hf_config, name)})"
            )
