"""Packed pushes (`sync.quant_wire: packed`): fp8_block weights travel as fp8 values + fp32 block scales, in the
checkpoint layout SGLang's fp8 method loads. SGLang's fp8 kernels need a GPU, so here the layout is checked against
the two consumers that run on CPU: transformers' loader of the same layout, and SGLang's own config parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from miles_sync import build_sender, read_buckets, sync_config, weight_fingerprint
from miles_sync.formats import QuantizationError, fake_quantize, quantizable
from miles_sync.formats.packed import quantization_config, unpack, write_packed_checkpoint

HIDDEN = 256  # a whole number of 128×128 blocks


def weights() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(64, HIDDEN)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(HIDDEN, HIDDEN) * 0.05),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(HIDDEN, 2 * HIDDEN) * 0.05),
        ("model.layers.0.input_layernorm.weight", torch.ones(HIDDEN)),
    ]


def test_packed_push_carries_fp8_values_and_fp32_block_scales():
    sender = build_sender(
        sync_config(transport="tensor", dtype="bfloat16", quantization="fp8_block", quant_wire="packed")
    )
    try:
        handle = sender.publish(weights(), weight_version=3)
        received = [(name, t.clone()) for bucket in read_buckets(handle) for name, t in bucket]
    finally:
        sender.close()
    got = dict(received)
    assert handle.packed == "fp8_block"
    q = "model.layers.0.self_attn.q_proj.weight"
    assert got[q].dtype == torch.float8_e4m3fn and got[q].shape == (HIDDEN, HIDDEN)
    assert got[q + "_scale_inv"].dtype == torch.float32 and got[q + "_scale_inv"].shape == (2, 2)
    assert got["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 4)
    # the rest travels cast to the wire dtype, with no scales
    assert got["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "model.embed_tokens.weight_scale_inv" not in got
    assert handle.num_tensors == 6 and handle.fingerprint == weight_fingerprint(received)
    # fp8 + scales carry about half the bytes of the bf16 values of the same weights
    assert got[q].numel() * 1 + 4 * 4 < 0.51 * HIDDEN * HIDDEN * 2
    # what the engine computes with is exactly the grid the values path sends (and the trainer's QAT uses)
    for name, tensor in unpack(received, "fp8_block"):
        original = dict(weights())[name]
        if quantizable(name, original.shape):
            assert torch.equal(tensor, fake_quantize(original, "fp8_block", name=name))


def test_a_packed_weight_without_its_scales_is_refused():
    data = torch.zeros(HIDDEN, HIDDEN, dtype=torch.float8_e4m3fn)
    with pytest.raises(QuantizationError, match="q_proj.weight_scale_inv"):
        list(unpack([("l.q_proj.weight", data)], "fp8_block"))


def test_packed_needs_fp8_block_on_the_tensor_transport():
    with pytest.raises(ValidationError, match="sync.quant_wire: packed needs sync.quantization: fp8_block"):
        sync_config(transport="tensor", quantization="int4", quant_wire="packed")
    with pytest.raises(ValidationError, match="sync.transport: tensor"):
        sync_config(transport="disk", quantization="fp8_block", quant_wire="packed")
    with pytest.raises(QuantizationError, match="cannot travel packed"):
        quantization_config("nvfp4")


def tiny_checkpoint(folder: Path) -> Path:
    """A random one-layer Qwen2 in bf16 whose projections are whole 128×128 blocks."""
    from miles_control.testing.tiny_models import save_tiny_model, tiny_model

    config = tiny_model(
        "qwen2", vocab_size=64, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
    )  # fmt: skip
    return save_tiny_model(folder, config, dtype="bfloat16")


def test_the_packed_checkpoint_loads_in_transformers_as_the_grid_values(tmp_path):
    """transformers reads the same layout (fp8 `weight` + `weight_scale_inv`, `quant_method: fp8` with
    `weight_block_size`) and, on CPU, dequantizes it: it must get exactly the trainer's fake-quantized weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    source = tiny_checkpoint(tmp_path / "bf16")
    packed = write_packed_checkpoint(source, tmp_path / "fp8", "fp8_block")
    assert json.loads((packed / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    model = AutoModelForCausalLM.from_pretrained(str(packed), quantization_config=FineGrainedFP8Config(dequantize=True))
    loaded = model.state_dict()
    original = load_file(str(source / "model.safetensors"))
    checked = 0
    for name, tensor in original.items():
        if quantizable(name, tensor.shape):
            expected = fake_quantize(tensor.float(), "fp8_block", name=name).to(loaded[name].dtype)
            assert torch.equal(loaded[name], expected), name
            checked += 1
        elif name in loaded:
            assert torch.equal(loaded[name], tensor), name
    assert checked == 7  # q, k, v, o, gate, up, down


def test_sglang_reads_the_config_as_block_fp8(tmp_path):
    """SGLang's own parser of config.json's quantization_config (its CPU import needs the sgl_kernel shim, so it
    runs in a child process)."""
    pytest.importorskip("sglang")
    shim = Path(__file__).parents[2] / "miles-rollout/src/miles_rollout/engines/sglang/cpu_shim"
    code = (
        "import json, sys\n"
        "from sglang.srt.layers.quantization.fp8 import Fp8Config\n"
        "c = Fp8Config.from_config(json.loads(sys.argv[1]))\n"
        "print(json.dumps([c.get_name(), c.is_checkpoint_fp8_serialized, c.weight_block_size, c.activation_scheme]))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(quantization_config("fp8_block"))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["fp8", True, [128, 128], "dynamic"]
