"""HF (Qwen2 / Qwen3 / Llama) ⇄ megatron-core GPTModel: the model config and the weight layouts.

Layouts (megatron-core's local layer spec, tensor-parallel size `tp`, rank `r`):
- `linear_qkv` fuses q, k and v per key-value group: for each of the `ng` groups, the group's
  `nh/ng` query heads, then its key head, then its value head (rows of `head_dim`); TP ranks take
  consecutive groups (`chunk(tp, 0)[r]`). The bias follows the same layout.
- `linear_fc1` fuses gate and up per rank: `cat(gate.chunk(tp)[r], up.chunk(tp)[r])`.
- `linear_proj` (o_proj) and `linear_fc2` (down_proj) split their input dimension (dim 1).
- the word embedding and the output layer split the vocabulary (dim 0), padded with zero rows to a
  multiple of `tp`; the padding is sliced off the logits and off the exported tensors.
- layer norms are replicated, Qwen3's per-head q/k norms (`q_layernorm`, `k_layernorm`) too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from miles_sync import TIED_HEAD
from miles_train.backends.distributed import pad_rows, padded_vocab
from miles_train.backends.hf_family import check_rebuildable, has_qk_norm, has_qkv_bias, head_dim, rope_parameters


def check_supported(hf_config: Any, tp: int) -> None:
    """Raise UnsupportedModel unless Megatron's rebuilt model honours `hf_config` split over `tp` ranks (each
    rank holds whole key-value groups)."""
    check_rebuildable(hf_config, "megatron", tp, ("num_key_value_heads", "intermediate_size"))


# fused kernels need Transformer Engine / apex; the plain ops give the same numbers
_FUSIONS = (
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
)


def transformer_config(hf_config: Any, tp: int, precision: str = "fp32"):
    """The megatron-core TransformerConfig of an HF Qwen2/Qwen3/Llama config (dropout off). `precision`
    (train.precision) sets Megatron's own bf16 / fp16 flags; the model is built in fp32 and cast by Megatron's
    Float16Module (parallelize.py)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        kv_channels=head_dim(hf_config),
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        qk_layernorm=has_qk_norm(hf_config),
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        params_dtype=torch.float32,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        # weights come from the HF checkpoint: build on the host, skip random initialisation
        use_cpu_initialization=True,
        perform_initialization=False,
        **dict.fromkeys(_FUSIONS, False),
    )


def build_gpt_model(hf_config: Any, tp: int, max_sequence_length: int | None = None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        transformer_config(hf_config, tp),
        get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=has_qk_norm(hf_config)),
        vocab_size=padded_vocab(hf_config.vocab_size, tp),
        max_sequence_length=max_sequence_length or hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rope_parameters(hf_config).get("rope_theta", 10000)),
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        parallel_output=True,
    )


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ng: int) -> torch.Tensor:
    """HF q/k/v (rows = heads × head_dim) → Megatron's per-group [q…, k, v] rows."""
    qs, ks, vs = q.chunk(ng, 0), k.chunk(ng, 0), v.chunk(ng, 0)
    return torch.cat([torch.cat(parts, 0) for parts in zip(qs, ks, vs, strict=True)], 0)


def _split_qkv(fused: torch.Tensor, hf_config: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, nh, hd = hf_config.num_key_value_heads, hf_config.num_attention_heads, head_dim(hf_config)
    q_rows = nh // ng * hd
    groups = [g.split([q_rows, hd, hd], 0) for g in fused.chunk(ng, 0)]
    return tuple(torch.cat([g[i] for g in groups], 0) for i in range(3))  # type: ignore[return-value]


def hf_to_megatron(hf: dict[str, torch.Tensor], hf_config: Any, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """The tensors of TP rank `rank`, under GPTModel parameter names. Every HF tensor must find a
    place (a checkpoint with more than the config says raises instead of being dropped)."""
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        used.add(name)
        return hf[name]

    ng = hf_config.num_key_value_heads
    vocab = padded_vocab(hf_config.vocab_size, tp)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out = {"embedding.word_embeddings.weight": pad_rows(get("model.embed_tokens.weight"), vocab).chunk(tp, 0)[rank]}
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = get(h + "input_layernorm.weight")
        qkv = _fused_qkv(get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight"), ng)
        out[m + "self_attention.linear_qkv.weight"] = qkv.chunk(tp, 0)[rank]
        if has_qkv_bias(hf_config):
            bias = _fused_qkv(get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"), ng)
            out[m + "self_attention.linear_qkv.bias"] = bias.chunk(tp, 0)[rank]
        out[m + "self_attention.linear_proj.weight"] = get(attn + "o_proj.weight").chunk(tp, 1)[rank]
        if has_qk_norm(hf_config):
            out[m + "self_attention.q_layernorm.weight"] = get(attn + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = get(attn + "k_norm.weight")
        out[m + "pre_mlp_layernorm.weight"] = get(h + "post_attention_layernorm.weight")
        gate, up = get(h + "mlp.gate_proj.weight"), get(h + "mlp.up_proj.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], 0)
        out[m + "mlp.linear_fc2.weight"] = get(h + "mlp.down_proj.weight").chunk(tp, 1)[rank]
    out["decoder.final_layernorm.weight"] = get("model.norm.weight")
    if not tied:
        out["output_layer.weight"] = pad_rows(get("lm_head.weight"), vocab).chunk(tp, 0)[rank]
    ignorable = {TIED_HEAD} if tied else set()  # a tied head is the embedding (miles_sync.naming)
    unused = sorted(n for n in set(hf) - used - ignorable if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"megatron backend: the checkpoint has tensors the model has no place for: {unused[:5]}")
    return out


def megatron_to_hf(shards: dict[str, list[torch.Tensor]], hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """From every TP rank's tensor of each GPTModel parameter (rank order) to full HF tensors, in
    the order of an HF state dict; a tied head is the embedding and is not named twice (miles_sync.naming)."""
    vocab = hf_config.vocab_size

    def whole(name: str, dim: int) -> torch.Tensor:
        return torch.cat(shards[name], dim)

    yield "model.embed_tokens.weight", whole("embedding.word_embeddings.weight", 0)[:vocab]
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        q, k, v = _split_qkv(whole(m + "self_attention.linear_qkv.weight", 0), hf_config)
        yield attn + "q_proj.weight", q
        if has_qkv_bias(hf_config):
            qb, kb, vb = _split_qkv(whole(m + "self_attention.linear_qkv.bias", 0), hf_config)
            yield attn + "q_proj.bias", qb
        yield attn + "k_proj.weight", k
        if has_qkv_bias(hf_config):
            yield attn + "k_proj.bias", kb
        yield attn + "v_proj.weight", v
        if has_qkv_bias(hf_config):
            yield attn + "v_proj.bias", vb
        yield attn + "o_proj.weight", whole(m + "self_attention.linear_proj.weight", 1)
        if has_qk_norm(hf_config):
            yield attn + "q_norm.weight", shards[m + "self_attention.q_layernorm.weight"][0]
            yield attn + "k_norm.weight", shards[m + "self_attention.k_layernorm.weight"][0]
        fc1 = [s.chunk(2, 0) for s in shards[m + "mlp.linear_fc1.weight"]]
        yield h + "mlp.gate_proj.weight", torch.cat([g for g, _ in fc1], 0)
        yield h + "mlp.up_proj.weight", torch.cat([u for _, u in fc1], 0)
        yield h + "mlp.down_proj.weight", whole(m + "mlp.linear_fc2.weight", 1)
        yield h + "input_layernorm.weight", shards[m + "input_layernorm.weight"][0]
        yield h + "post_attention_layernorm.weight", shards[m + "pre_mlp_layernorm.weight"][0]
    yield "model.norm.weight", shards["decoder.final_layernorm.weight"][0]
    if "output_layer.weight" in shards:
        yield "lm_head.weight", whole("output_layer.weight", 0)[:vocab]
