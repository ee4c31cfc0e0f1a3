"""HF ⇄ backend weight layouts and configuration errors, without starting any rank."""

import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from miles_control.testing.tiny_models import tiny_model
from miles_sync import without_tied_head
from miles_train.config import TrainConfig


def _qwen2(vocab: int = 19) -> tuple[Qwen2Config, dict[str, torch.Tensor]]:
    config = tiny_model("qwen2", vocab_size=vocab, intermediate_size=48, num_attention_heads=8)
    torch.manual_seed(1)
    return config, Qwen2ForCausalLM(config).state_dict()


def _llama() -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    config = tiny_model("llama", vocab_size=21, intermediate_size=48, num_hidden_layers=1, num_key_value_heads=4)
    torch.manual_seed(2)
    return config, LlamaForCausalLM(config).state_dict()


def _qwen3() -> tuple[Qwen3Config, dict[str, torch.Tensor]]:
    """Qwen3: per-head q/k RMSNorm, no biases, a head_dim wider than hidden_size / heads."""
    config = tiny_model("qwen3", vocab_size=23, intermediate_size=48)
    torch.manual_seed(3)
    return config, dict(Qwen3ForCausalLM(config).state_dict())


@pytest.mark.parametrize("make", [_qwen2, _llama, _qwen3], ids=["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_layouts_round_trip(make, tp):
    """Split for every TP rank, then put back together: the HF tensors again, bit for bit (an odd
    vocabulary is padded to a multiple of TP on the way in and trimmed on the way out)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from miles_train.backends.distributed import padded_vocab
    from miles_train.backends.megatron import convert

    config, hf = make()
    convert.check_supported(config, tp)
    per_rank = [convert.hf_to_megatron(hf, config, tp, r) for r in range(tp)]
    vocab = padded_vocab(config.vocab_size, tp)
    assert vocab % tp == 0 and vocab >= config.vocab_size
    assert per_rank[0]["embedding.word_embeddings.weight"].shape[0] == vocab // tp
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in per_rank[0]) == (config.model_type == "qwen2")
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in per_rank[0]) == (config.model_type == "qwen3")
    shards = {name: [rank[name] for rank in per_rank] for name in per_rank[0]}
    back = dict(convert.megatron_to_hf(shards, config))
    assert list(back) == [n for n in hf if n in back]  # an HF state dict's order
    expected = dict(without_tied_head(hf.items(), config.tie_word_embeddings))  # a tied head is sent once
    assert set(back) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def test_megatron_rejects_layouts_it_cannot_split():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from miles_train.backends.megatron import convert

    config, _ = _qwen2()
    with pytest.raises(ValueError, match="num_key_value_heads"):
        convert.check_supported(config, 4)  # 2 kv heads over 4 ranks
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="gpt2"):
        convert.check_supported(config, 1)


@pytest.mark.parametrize(
    ("setting", "value", "named"),
    [
        ("attention_bias", True, "attention_bias: True"),
        ("mlp_bias", True, "mlp_bias: True"),
        ("hidden_act", "gelu", "hidden_act: 'gelu'"),
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4}, "rope_parameters.rope_type: 'llama3'"),
        ("use_sliding_window", True, "use_sliding_window: True"),
        ("num_local_experts", 8, "num_local_experts: 8"),
        ("model_type", "phi3", "model_type: 'phi3'"),
    ],
)
def test_settings_the_rebuilt_models_lack_are_refused_naming_the_field(setting, value, named):
    """A Llama with biases or another activation would otherwise train with those weights dropped."""
    from miles_train.backends.hf_family import check_family

    config, _ = _llama()
    setattr(config, setting, value)
    for backend in ("megatron", "torchtitan"):
        with pytest.raises(ValueError, match=f"{backend} backend: config.json {re.escape(named)} is not supported"):
            check_family(config, backend)


def test_mistral_is_rebuilt_as_llama_unless_its_sliding_window_is_shorter_than_its_context():
    from miles_control.testing.tiny_models import tiny_model
    from miles_train.backends.hf_family import check_family

    v03 = tiny_model("mistral", max_position_embeddings=256)  # sliding_window null (Mistral v0.3)
    for backend in ("megatron", "torchtitan"):
        check_family(v03, backend)
    v01 = tiny_model("mistral", max_position_embeddings=256, sliding_window=64)  # Mistral v0.1: 4096 of 32768
    with pytest.raises(ValueError, match=r"megatron backend: config.json sliding_window: 64 is not supported"):
        check_family(v01, "megatron")
    check_family(tiny_model("mistral", max_position_embeddings=256, sliding_window=256), "torchtitan")  # never slides


def _moe_checkpoint(family: str) -> tuple:
    """A tiny mixture of experts' config and its checkpoint's tensors (per expert, as save_pretrained writes them)."""
    from transformers import AutoModelForCausalLM

    from miles_train.backends.fsdp2 import convert

    config = tiny_model(family, vocab_size=19)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config)
    return config, {name: t.clone() for name, t in convert.to_hf(model, dict(model.state_dict()))}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_megatron_expert_layouts_round_trip(family, ep):
    """Each expert-parallel rank takes its consecutive experts (gate and up fused); gathered under their global
    index, every checkpoint tensor comes back bit for bit, in the checkpoint's names."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from miles_train.backends.megatron import convert

    config, hf = _moe_checkpoint(family)
    convert.check_supported(config, 1, ep)
    per_rank = [convert.hf_to_megatron(hf, config, 1, 0, ep, r) for r in range(ep)]
    local = 4 // ep
    assert {n for n in per_rank[0] if convert.is_expert(n) and n.startswith("decoder.layers.0.")} == {
        f"decoder.layers.0.mlp.experts.local_experts.{i}.{fc}.weight"
        for i in range(local)
        for fc in ("linear_fc1", "linear_fc2")
    }
    shards: dict[str, list[torch.Tensor]] = {}
    for rank, tensors in enumerate(per_rank):
        for name, tensor in tensors.items():
            key = convert.global_expert_name(name, rank, local) if convert.is_expert(name) else name
            shards.setdefault(key, [tensor])
    prefix = "block_sparse_moe" if family == "mixtral" else "mlp"
    up = "w3" if family == "mixtral" else "up_proj"
    fc1 = shards["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"][0]  # on the last rank
    assert torch.equal(fc1[fc1.shape[0] // 2 :], hf[f"model.layers.1.{prefix}.experts.3.{up}.weight"])
    back = dict(convert.megatron_to_hf(shards, config))
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_what_the_backends_cannot_split_of_a_mixture_of_experts_is_refused_naming_the_field():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from miles_train.backends.hf_family import check_rebuildable
    from miles_train.backends.megatron import convert

    moe = tiny_model("qwen3_moe", vocab_size=19)
    with pytest.raises(ValueError, match="expert_parallel_size 3 must divide config.json num_local_experts"):
        convert.check_supported(moe, 1, 3)
    with pytest.raises(ValueError, match="with tensor_parallel_size 2: .* split them over ranks with expert_parallel"):
        convert.check_supported(moe, 2)
    with pytest.raises(ValueError, match="expert_parallel_size 2 needs a mixture of experts"):
        convert.check_supported(tiny_model("qwen3", vocab_size=19), 1, 2)
    with pytest.raises(ValueError, match=r"config.json mlp_only_layers: \[1\] is not supported"):
        convert.check_supported(tiny_model("qwen3_moe", vocab_size=19, mlp_only_layers=[1]), 1)
    with pytest.raises(ValueError, match=r"torchtitan backend: a mixture of experts .* tensor_parallel_size 2"):
        check_rebuildable(moe, "torchtitan", 2, ())
    with pytest.raises(ValueError, match=r"world_size \(2\) must be a multiple of expert_parallel_size \(4\)"):
        TrainConfig.model_validate({"backend": {"type": "megatron", "world_size": 2, "expert_parallel_size": 4}})


def test_megatron_refuses_checkpoint_tensors_it_has_no_place_for():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from miles_train.backends.megatron import convert

    config, hf = _llama()
    hf["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(config.hidden_size)
    with pytest.raises(ValueError, match="o_proj.bias"):
        convert.hf_to_megatron(hf, config, 1, 0)


def test_torchtitan_rejects_layouts_it_cannot_split():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    from miles_train.backends.torchtitan import convert

    config, _ = _qwen2()
    with pytest.raises(ValueError, match="num_key_value_heads"):
        convert.check_supported(config, 4)  # 2 kv heads over 4 ranks
    convert.check_supported(config, 2)


@pytest.mark.parametrize("make", [_qwen2, _qwen3], ids=["qwen2", "qwen3"])
def test_torchtitan_adapter_maps_every_hf_tensor(make):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    from miles_train.backends.torchtitan import convert

    config, hf = make()
    hf = dict(without_tied_head(hf.items(), config.tie_word_embeddings))
    adapter = convert.state_dict_adapter(convert.model_config(config))
    titan = adapter.from_hf(dict(hf))
    assert ("layers.0.attention.qkv_linear.wq.bias" in titan) == (config.model_type == "qwen2")
    assert ("layers.0.attention.q_norm.weight" in titan) == (config.model_type == "qwen3")
    back = adapter.to_hf(titan)
    assert set(back) == set(hf)
    assert all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("deepspeed", "unknown backend 'deepspeed'; choose one of fsdp2, megatron, torchtitan"),
        (
            {"type": "megatron", "world_size": 3, "tensor_parallel_size": 2},
            "must be a multiple of tensor_parallel_size",
        ),
        ({"type": "fsdp2", "tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_backend_config_errors_name_the_field(backend, message):
    with pytest.raises(ValueError, match="backend") as err:
        TrainConfig.model_validate({"backend": backend})
    assert message in str(err.value)


def test_backend_by_name_and_default():
    assert TrainConfig.model_validate({"backend": "torchtitan"}).backend.type == "torchtitan"
    with pytest.raises(ValueError, match="a backend mapping names its type"):  # no silent default kind
        TrainConfig.model_validate({"backend": {"world_size": 2}})
    # a job stored before train.grpo.staleness_max was renamed (and moved to train.algorithm) still loads
    with pytest.warns(FutureWarning, match="train.grpo is deprecated"):
        assert TrainConfig.model_validate({"grpo": {"staleness_max": 3}}).algorithm.drop_older_than == 3
    megatron = TrainConfig.model_validate({"backend": {"type": "megatron", "world_size": 4, "tensor_parallel_size": 2}})
    assert megatron.backend.data_parallel_size == 2


def test_a_mixture_of_experts_travels_as_its_checkpoint_and_back(tmp_path):
    """Qwen3-MoE: transformers holds each layer's experts fused in 3-D parameters and saves them per expert. The
    fsdp2 export gives the saved checkpoint's names, shapes and values as views (no copy), writing a view writes
    the parameter, and the model's state comes back from the checkpoint's tensors bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles_control.testing.tiny_models import save_tiny_model
    from miles_train.backends.fsdp2 import convert

    folder = save_tiny_model(tmp_path, tiny_model("qwen3_moe", vocab_size=19), seed=4)
    saved = load_file(str(folder / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    state = dict(model.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # fused in memory
    exported = dict(convert.to_hf(model, state))
    assert set(exported) == set(saved)  # per expert on the wire, as on disk
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    assert all(t.untyped_storage().data_ptr() in storages for t in exported.values())  # views, not copies
    up = exported["model.layers.1.mlp.experts.3.up_proj.weight"]
    up.fill_(7.0)  # expert 3's up projection is the second half of its gate_up rows
    assert torch.all(state["model.layers.1.mlp.experts.gate_up_proj"][3, up.shape[0] :] == 7.0)
    assert not torch.any(state["model.layers.1.mlp.experts.gate_up_proj"][3, : up.shape[0]] == 7.0)
    back = convert.from_hf(model, saved)
    assert set(back) == set(model.state_dict())
    for name, tensor in AutoModelForCausalLM.from_pretrained(str(folder)).state_dict().items():
        assert torch.equal(back[name], tensor), name
    assert convert.converted(model, state) == [n for n in state if ".mlp.experts." in n]


def test_a_layout_that_is_not_a_block_of_the_model_tensor_is_refused():
    from miles_sync.naming import checkpoint_views

    def transposed(tensors: dict) -> dict:  # a conversion no view can express
        return {f"{name}.t": t.t() for name, t in tensors.items()}

    with pytest.raises(ValueError, match="w.t: the checkpoint's tensor is not one contiguous block of the model's w"):
        checkpoint_views({"w": torch.zeros(3, 4)}, transposed)

    def halved(tensors: dict) -> dict:
        return dict(zip(("a", "b"), tensors["w"].chunk(2), strict=True))

    halves = checkpoint_views({"w": torch.arange(12.0).view(4, 3)}, halved)
    assert torch.equal(halves["b"], torch.arange(6.0, 12.0).view(2, 3))
