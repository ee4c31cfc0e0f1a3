"""Tiny random-weight Hugging Face models for the tests, the architecture matrix and the benchmarks: one config
factory, `tiny_model(family, **overrides)`, and `save_tiny_model`, which writes one (with its tokenizer) to a folder
once. Built from code at run time, so no weights live in git; not needed at run time."""

from __future__ import annotations

import copy
import inspect
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# The widths every family starts from: two layers, grouped-query attention (4 query heads share 2 key/value heads),
# and an odd vocabulary, so that a tensor-parallel layout must pad it. A field the family's config does not take
# (GPT-2 has no key/value heads, no `intermediate_size`) is left out; the context (`max_position_embeddings`) is the
# family's unless overridden.
TINY: dict[str, Any] = {
    "vocab_size": 19,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

# Llama 3.2's RoPE scaling (`rope_type: llama3`, which megatron and torchtitan refuse)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# family → (transformers config class, the fields that set it apart, as the released models ship them)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # q/k/v biases
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    # Qwen2.5-0.5B/1.5B: tied head
    "qwen2.5": (
        "Qwen2Config",
        {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    ),
    # per-head q/k RMSNorm, head_dim wider than hidden / heads, tied head
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 16}),
    # no biases anywhere
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    # Llama 3 (8B): untied head, default RoPE
    "llama3": (
        "LlamaConfig",
        {"tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}},
    ),
    # Llama 3.2 (1B/3B): tied head and llama3 RoPE scaling
    "llama3.2": ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    # Mistral v0.3 (7B): Llama's layer, no sliding window, untied head
    "mistral": (
        "MistralConfig",
        {
            "tie_word_embeddings": False,
            "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    ),
    # Phi-3 (mini): q/k/v fused in one qkv_proj and gate/up in one gate_up_proj in the checkpoint
    "phi3": ("Phi3Config", {"tie_word_embeddings": False, "sliding_window": None}),
    # OLMo-2: norms after attention and MLP (not before), q/k RMSNorm over all heads
    "olmo2": ("Olmo2Config", {"tie_word_embeddings": False}),
    # Qwen3-MoE (30B-A3B): Qwen3's attention, every MLP a mixture of experts (top-2 of 4 here, probabilities
    # renormalised over the chosen), untied head
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "tie_word_embeddings": False,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    # Mixtral (8x7B): Llama's attention, every MLP a mixture of experts (`block_sparse_moe`, w1/w3/w2 per expert in
    # the checkpoint, top-2 renormalised), untied head, no sliding window
    "mixtral": (
        "MixtralConfig",
        {"tie_word_embeddings": False, "sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # Gemma 3 (text, e.g. gemma-3-270m): norms around attention and MLP, q/k RMSNorm, embeddings scaled by
    # sqrt(hidden), sliding-window layers between global ones, tied head
    "gemma3_text": (
        "Gemma3TextConfig",
        {"tie_word_embeddings": True, "head_dim": 16, "sliding_window": 32, "query_pre_attn_scalar": 16},
    ),
    # Qwen2-MoE (Qwen1.5-MoE): q/k/v biases, routed experts beside a shared expert with its own sigmoid gate
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "norm_topk_prob": False,
        },
    ),
    # OLMoE: OLMo's q/k RMSNorm, every MLP 4 experts here (64 in OLMoE-1B-7B), top-2 without renormalising
    "olmoe": (
        "OlmoeConfig",
        {
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "num_key_value_heads": 4,
        },  # as OLMoE-1B-7B: as many kv heads as heads (SGLang's k_norm assumes it)
    ),
    # DeepSeek-V3: multi-head latent attention (low-rank q and kv, a rope part of the head), the first layer dense
    # (`first_k_dense_replace`), then routed experts (sigmoid scores with a score-correction bias buffer, group-limited
    # top-k, scaled) beside a shared expert; untied head
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "tie_word_embeddings": False,
            "num_hidden_layers": 3,
            "first_k_dense_replace": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "n_group": 2,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "q_lora_rank": 16,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "num_key_value_heads": 4,
            # YaRN, as DeepSeek-V3 ships it (SGLang's CPU rope path for MLA requires a scaling)
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },  # fmt: skip
        },
    ),
    # a family no backend rebuilds and SGLang's weight check does not know
    "gpt2": ("GPT2Config", {}),
}


def tiny_model(family: str, *, tokenizer: PreTrainedTokenizerBase | None = None, **overrides: Any) -> PretrainedConfig:
    """The config of a tiny model of `family` (a key of FAMILIES): TINY's widths, the family's own fields, then
    `overrides` (any field of the family's config, e.g. `tie_word_embeddings=True`). With `tokenizer`, the
    vocabulary and the padding and end-of-sequence ids are the tokenizer's."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    class_name, family_fields = FAMILIES[family]
    config_class = getattr(transformers, class_name)
    takes = set(inspect.signature(config_class.__init__).parameters) | set(config_class.attribute_map)
    sized = {}
    if tokenizer is not None:
        sized = {
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    base = {name: value for name, value in TINY.items() if name in takes}
    # copied, so that no config shares a nested field (rope_parameters) with FAMILIES
    fields = base | copy.deepcopy(family_fields) | sized | overrides
    return config_class(**fields)


def save_tiny_model(
    folder: str | Path,
    config: PretrainedConfig,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Random weights for `config`, drawn after `torch.manual_seed(seed)` and saved in `dtype` as an HF folder,
    with `tokenizer` when given. Written once: a folder that already holds a model is returned as it is, and a new
    one appears whole or not at all (written next to it, then renamed; an empty folder gives way)."""
    import torch
    import transformers

    from miles_sync.vision import model_class_name

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    model = getattr(transformers, model_class_name(config)).from_config(config).to(getattr(torch, dtype))
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    if folder.exists():
        folder.rmdir()
    partial.rename(folder)
    return folder


# Vision-language families: (config class, processor class, the text model's fields, the vision tower's). The tower
# is two blocks of width 32 whose output is the text model's width; images are cut into patches of `patch_size`
# pixels and every 2 × 2 patches make one placeholder id, so a 56 × 56 image is 4 ids (Qwen2.5-VL's 14-pixel patches).
VISION_FAMILIES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any]]] = {
    # Qwen2.5-VL: a windowed-attention ViT (full attention in the blocks of `fullatt_block_indexes`), 3-D RoPE in the
    # text model (`mrope_section`: the rotary dims given to time, height and width)
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLProcessor",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 1, 1]}},
        {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },  # fmt: skip
    ),
    # Qwen3-VL: a ViT with learned position embeddings whose intermediate layers also feed the text model's first
    # layers (`deepstack_visual_indexes`), per-head q/k RMSNorm and interleaved 3-D RoPE in the text model
    "qwen3_vl": (
        "Qwen3VLConfig",
        "Qwen3VLProcessor",
        {
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },  # fmt: skip
        {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "patch_size": 14,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },  # fmt: skip
    ),
}
# what the tiny vision-language models read and write: digits, operators, lower-case words
VISION_ALPHABET = "0123456789+-*=? abcdefghijklmnopqrstuvwxyz"
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>")
# Qwen's chat layout, images as `<|vision_start|><|image_pad|><|vision_end|>` (the processor repeats the pad)
VISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vision_processor(family: str) -> Any:
    """The processor of a tiny vision-language model of `family`: a character tokenizer with Qwen's vision and turn
    tokens, the chat template above, and the family's image processor for images of 28² to 56² pixels."""
    import transformers

    from miles_rollout.tasks.arithmetic import build_char_tokenizer

    tokenizer = build_char_tokenizer(VISION_ALPHABET)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VISION_TEMPLATE
    patch = VISION_FAMILIES[family][3]["patch_size"]
    sizes = {"size": {"shortest_edge": (2 * patch) ** 2, "longest_edge": (4 * patch) ** 2}}
    images = transformers.Qwen2VLImageProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2, **sizes)
    videos = transformers.Qwen2VLVideoProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2, **sizes)
    processor_class = getattr(transformers, VISION_FAMILIES[family][1])
    return processor_class(
        image_processor=images, tokenizer=tokenizer, video_processor=videos, chat_template=VISION_TEMPLATE
    )


def tiny_vision_model(family: str, processor: Any) -> PretrainedConfig:
    """The config of a tiny vision-language model of `family` (a key of VISION_FAMILIES) over `processor`'s
    tokenizer: the text model at TINY's widths, a two-block vision tower, untied head."""
    import transformers

    if family not in VISION_FAMILIES:
        raise ValueError(f"unknown vision-language family {family!r}; choose one of {', '.join(VISION_FAMILIES)}")
    class_name, _, text_fields, vision_fields = VISION_FAMILIES[family]
    tokenizer = processor.tokenizer
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}  # fmt: skip
    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    text = {**TINY, "vocab_size": len(tokenizer), "tie_word_embeddings": False, **special}
    text |= copy.deepcopy(text_fields)
    vision = {"out_hidden_size": TINY["hidden_size"], "spatial_merge_size": 2, "temporal_patch_size": 2}
    vision |= copy.deepcopy(vision_fields)
    return getattr(transformers, class_name)(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **ids, **special
    )


def save_tiny_vision_model(folder: str | Path, family: str, *, seed: int = 0, dtype: str = "float32") -> Path:
    """A tiny random vision-language model of `family` with its processor (tokenizer, chat template, image
    processor) as an HF folder in `dtype`, written once (see `save_tiny_model`)."""
    processor = tiny_vision_processor(family)
    # the processor saves like a tokenizer (its tokenizer, template and image processor, in the same folder)
    return save_tiny_model(folder, tiny_vision_model(family, processor), tokenizer=processor, seed=seed, dtype=dtype)
