"""HF (Qwen2 / Qwen3 / Llama, and the mixtures of experts Qwen3-MoE / Mixtral) ⇄ megatron-core GPTModel: the model
config and the weight layouts.

Layouts (megatron-core's local layer spec, tensor-parallel size `tp`, rank `r`):
- `linear_qkv` fuses q, k and v per key-value group: for each of the `ng` groups, the group's
  `nh/ng` query heads, then its key head, then its value head (rows of `head_dim`); TP ranks take
  consecutive groups (`chunk(tp, 0)[r]`). The bias follows the same layout.
- `linear_fc1` fuses gate and up per rank: `cat(gate.chunk(tp)[r], up.chunk(tp)[r])`.
- `linear_proj` (o_proj) and `linear_fc2` (down_proj) split their input dimension (dim 1).
- the word embedding and the output layer split the vocabulary (dim 0), padded with zero rows to a
  multiple of `tp`; the padding is sliced off the logits and off the exported tensors.
- layer norms are replicated, Qwen3's per-head q/k norms (`q_layernorm`, `k_layernorm`) too.
- a mixture of experts (tensor-parallel size 1) is megatron's MoELayer: the router (`mlp.router.weight`, the
  checkpoint's `gate`) on every rank, and expert-parallel rank `e` of `ep` holds the `n/ep` consecutive experts
  `e·n/ep …` as `mlp.experts.local_experts.<l>` (`linear_fc1` = cat(gate, up), `linear_fc2` = down), the checkpoint's
  `mlp.experts.<j>.{gate,up,down}_proj` (Qwen3-MoE) or `block_sparse_moe.experts.<j>.{w1,w3,w2}` (Mixtral).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from miles_sync import TIED_HEAD
from miles_train.backends.distributed import pad_rows, padded_vocab
from miles_train.backends.hf_family import (
    UnsupportedModel,
    check_rebuildable,
    experts_field,
    has_qk_norm,
    has_qkv_bias,
    head_dim,
    moe_ffn_size,
    num_experts,
    rope_parameters,
)


def check_supported(hf_config: Any, tp: int, ep: int = 1) -> None:
    """Raise UnsupportedModel unless Megatron's rebuilt model honours `hf_config` split over `tp` tensor-parallel
    ranks (each holding whole key-value groups) and `ep` expert-parallel ranks (each holding whole experts)."""
    field = experts_field(hf_config)
    check_rebuildable(hf_config, "megatron", tp, ("num_key_value_heads",))
    if ep > 1 and not field:
        raise UnsupportedModel(
            f"megatron backend: expert_parallel_size {ep} needs a mixture of experts, and config.json has no "
            "num_experts / num_local_experts"
        )
    if field and num_experts(hf_config) % ep:
        raise UnsupportedModel(
            f"megatron backend: expert_parallel_size {ep} must divide config.json {field} ({num_experts(hf_config)})"
        )


def _moe_names(hf_config: Any) -> tuple[str, tuple[str, str, str]]:
    """A layer's mixture of experts in the checkpoint: its prefix and the gate / up / down names of an expert."""
    if hf_config.model_type == "mixtral":
        return "block_sparse_moe.", ("w1", "w3", "w2")
    return "mlp.", ("gate_proj", "up_proj", "down_proj")


def _moe_config(hf_config: Any, ep: int) -> dict[str, Any]:
    """TransformerConfig fields of a mixture of experts as transformers computes it: softmax over the router's
    logits, top-k, the chosen weights renormalised (Mixtral always, Qwen3-MoE with `norm_topk_prob`; megatron's
    softmax over the top-k logits is the same), no load-balancing loss (transformers adds one only when asked for
    router logits), the all-gather token dispatcher (the all-to-all one needs CUDA streams)."""
    if not num_experts(hf_config):
        return {"ffn_hidden_size": hf_config.intermediate_size}
    renormalise = hf_config.model_type == "mixtral" or bool(getattr(hf_config, "norm_topk_prob", True))
    return {
        "ffn_hidden_size": moe_ffn_size(hf_config),
        "num_moe_experts": num_experts(hf_config),
        "moe_ffn_hidden_size": moe_ffn_size(hf_config),
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_router_pre_softmax": not renormalise,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "allgather",
        "expert_model_parallel_size": ep,
    }


# fused kernels need Transformer Engine / apex; the plain ops give the same numbers
_FUSIONS = (
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
)


def transformer_config(hf_config: Any, tp: int, precision: str = "fp32", ep: int = 1):
    """The megatron-core TransformerConfig of an HF Qwen2/Qwen3/Llama/Qwen3-MoE/Mixtral config (dropout off), its
    experts over `ep` expert-parallel ranks. `precision` (train.precision) sets Megatron's own bf16 / fp16 flags;
    the model is built in fp32 and cast by Megatron's Float16Module (parallelize.py)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
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
        **_moe_config(hf_config, ep),
        **dict.fromkeys(_FUSIONS, False),
    )


def build_gpt_model(hf_config: Any, tp: int, max_sequence_length: int | None = None, ep: int = 1):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    experts = num_experts(hf_config) or None  # each expert its own MLP (no grouped GEMM: that needs TE / CUDA)
    return GPTModel(
        transformer_config(hf_config, tp, ep=ep),
        get_gpt_layer_local_spec(
            num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=has_qk_norm(hf_config)
        ),
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


def hf_to_megatron(
    hf: dict[str, torch.Tensor], hf_config: Any, tp: int, rank: int, ep: int = 1, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """The tensors of TP rank `rank` and expert-parallel rank `ep_rank`, under GPTModel parameter names. Every HF
    tensor must find a place on some rank (a checkpoint with more than the config says raises instead of being
    dropped)."""
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
        if num_experts(hf_config):
            out |= _experts_to_megatron(get, hf_config, h, m, ep, ep_rank)
            continue
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


def _experts_to_megatron(get: Any, hf_config: Any, h: str, m: str, ep: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """One layer's router and this expert-parallel rank's experts (the others' are read too: they have a place)."""
    prefix, (gate, up, down) = _moe_names(hf_config)
    out = {m + "mlp.router.weight": get(h + prefix + "gate.weight")}
    n = num_experts(hf_config)
    for j in range(n):
        expert = f"{h}{prefix}experts.{j}."
        tensors = [get(f"{expert}{name}.weight") for name in (gate, up, down)]
        local, owner = j % (n // ep), j // (n // ep)
        if owner == ep_rank:
            fc = f"{m}mlp.experts.local_experts.{local}."
            out[fc + "linear_fc1.weight"] = torch.cat(tensors[:2], 0)
            out[fc + "linear_fc2.weight"] = tensors[2]
    return out


_LOCAL_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


def is_expert(name: str) -> bool:
    """Whether a GPTModel parameter belongs to one expert (held by one expert-parallel rank)."""
    return _LOCAL_EXPERT.match(name) is not None


def global_expert_name(name: str, ep_rank: int, local_experts: int) -> str:
    """A local expert's parameter under the expert's index in the whole layer (`local_experts.<global>`)."""
    match = _LOCAL_EXPERT.match(name)
    assert match is not None, name
    return f"{match.group(1)}{ep_rank * local_experts + int(match.group(2))}{match.group(3)}"


def megatron_to_hf(shards: dict[str, list[torch.Tensor]], hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """From every TP rank's tensor of each GPTModel parameter (rank order; experts under their global index, see
    `global_expert_name`) to full HF tensors, in the order of an HF state dict; a tied head is the embedding and is
    not named twice (miles_sync.naming)."""
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
        if num_experts(hf_config):
            prefix, (gate, up, down) = _moe_names(hf_config)
            yield h + prefix + "gate.weight", shards[m + "mlp.router.weight"][0]
            for j in range(num_experts(hf_config)):
                fc, expert = f"{m}mlp.experts.local_experts.{j}.", f"{h}{prefix}experts.{j}."
                gate_up = shards[fc + "linear_fc1.weight"][0].chunk(2, 0)
                yield f"{expert}{gate}.weight", gate_up[0]
                yield f"{expert}{up}.weight", gate_up[1]
                yield f"{expert}{down}.weight", shards[fc + "linear_fc2.weight"][0]
        else:
            fc1 = [s.chunk(2, 0) for s in shards[m + "mlp.linear_fc1.weight"]]
            yield h + "mlp.gate_proj.weight", torch.cat([g for g, _ in fc1], 0)
            yield h + "mlp.up_proj.weight", torch.cat([u for _, u in fc1], 0)
            yield h + "mlp.down_proj.weight", whole(m + "mlp.linear_fc2.weight", 1)
        yield h + "input_layernorm.weight", shards[m + "input_layernorm.weight"][0]
        yield h + "post_attention_layernorm.weight", shards[m + "pre_mlp_layernorm.weight"][0]
    yield "model.norm.weight", shards["decoder.final_layernorm.weight"][0]
    if "output_layer.weight" in shards:
        yield "lm_head.weight", whole("output_layer.weight", 0)[:vocab]
