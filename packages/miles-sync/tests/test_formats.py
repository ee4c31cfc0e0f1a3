"""Each low-precision format against vectors computed by hand from its specification, plus round-trip bounds."""

from __future__ import annotations

import pytest
import torch

from miles_sync import formats as F
from miles_sync.formats import QuantizationError

SUB = 2.0**-9  # E4M3's smallest subnormal


def roundtrip(rows, fmt, group_size=128):
    return F.dequantize(F.quantize(torch.tensor(rows, dtype=torch.float32), fmt, group_size)).tolist()


# ---- FP8 ---------------------------------------------------------------------------------------------------
def test_fp8_per_tensor_vectors():
    # amax 448 gives scale 1: E4M3's grid itself. [1, 2) has step 1/8: 1.0625 and 1.1875 are ties → even mantissa.
    assert roundtrip([[448.0, 1.0625, 1.1875, -2.0]], "fp8") == [[448.0, 1.0, 1.25, -2.0]]
    # subnormals: 0.4 and 0.6 of the smallest step round to 0 and 1 step; 1.5 steps is a tie → 2 steps (even).
    assert roundtrip([[448.0, 0.4 * SUB, 0.6 * SUB, 1.5 * SUB]], "fp8") == [[448.0, 0.0, SUB, 2 * SUB]]
    # the scale maps amax onto the format's max: 896 → scale 2, and 1.0625 · 2 ties back to 1.0 · 2
    assert roundtrip([[896.0, 2.125]], "fp8") == [[896.0, 2.0]]


def test_fp8_e5m2_and_scale():
    q = F.fp8.quantize(torch.tensor([[57344.0, 3.0, 1.25]]), dtype="e5m2")
    assert q.scales[0].item() == 1.0 and q.data.dtype == torch.float8_e5m2
    # E5M2 has 2 mantissa bits: 1.25 is on the grid, 3.0 too
    assert F.fp8.dequantize(q).tolist() == [[57344.0, 3.0, 1.25]]


def test_fp8_block_scales_are_independent():
    x = torch.ones(256, 256)
    x[:128, :128] *= 1000.0  # one loud block must not coarsen the others
    q = F.quantize(x, "fp8_block")
    assert q.scales[0].shape == (2, 2)
    assert q.scales[0][0, 0].item() == pytest.approx(1000.0 / 448.0)
    assert q.scales[0][1, 1].item() == pytest.approx(1.0 / 448.0)
    assert torch.equal(F.dequantize(q)[128:, 128:], x[128:, 128:])
    with pytest.raises(QuantizationError, match=r"128×128 blocks"):
        F.quantize(torch.ones(100, 256), "fp8_block")


# ---- MXFP8 -------------------------------------------------------------------------------------------------
def test_mxfp8_shared_power_of_two_scale():
    x = torch.ones(1, 64)
    x[0, 32:] = 3.0
    q = F.quantize(x, "mxfp8")
    # E8M0 (bias 127): floor(log2 1) − 8 = −8 → 119; floor(log2 3) − 8 = −7 → 120
    assert q.scales[0].view(torch.uint8).flatten().tolist() == [119, 120]
    assert torch.equal(F.dequantize(q), x)


def test_mxfp8_saturates_and_zero_block():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1] = 480.0, 1.0  # floor(log2 480) = 8 → scale 1: 480 is above E4M3's 448 and saturates
    out = F.dequantize(F.quantize(x, "mxfp8"))
    assert out[0, 0].item() == 448.0 and out[0, 1].item() == 1.0
    assert torch.equal(out[0, 32:], torch.zeros(32))  # the all-zero block stays zero
    with pytest.raises(QuantizationError, match="multiple of 32"):
        F.quantize(torch.ones(4, 48), "mxfp8")


# ---- NVFP4 -------------------------------------------------------------------------------------------------
def test_nvfp4_e2m1_grid_round_half_even():
    # amax 5.25 = 2688 · 2^-9 makes both scales exact: tensor scale 2^-9, block scale 448 (E4M3's max), so one step
    # of the block is 448 · 2^-9 = 0.875. On E2M1's grid (0, 0.5, 1, 1.5, 2, 3, 4, 6) the ties round to the even
    # code: 5 → 4, 2.5 → 2, 0.75 → 1 (1.0's mantissa is 0), 0.25 → 0.
    unit = 0.875
    row = [v * unit for v in (6.0, 5.0, 2.5, 0.75, 0.25, 1.5, -3.0, 0.0)] * 2
    out = roundtrip([row], "nvfp4")[0]
    assert out == [v * unit for v in (6.0, 4.0, 2.0, 1.0, 0.0, 1.5, -3.0, 0.0)] * 2


def test_nvfp4_blocks_and_packing():
    x = torch.tensor([[6.0] * 16 + [3.0, 1.5] * 8])  # the second block's amax is 3: its block scale halves
    q = F.quantize(x, "nvfp4")
    assert q.data.dtype == torch.uint8 and q.data.numel() == 16  # two E2M1 values per byte
    assert q.scales[0].dtype == torch.float8_e4m3fn and q.scales[0].numel() == 2
    assert q.scales[0].float()[0, 1].item() == pytest.approx(q.scales[0].float()[0, 0].item() / 2)
    assert F.dequantize(q) == pytest.approx(x, abs=1e-5)
    with pytest.raises(QuantizationError, match="multiple of 16"):
        F.quantize(torch.ones(2, 24), "nvfp4")


# ---- INT4 --------------------------------------------------------------------------------------------------
def test_int4_symmetric_groups():
    # scale = group amax / 7.5: amax 7.5 → scale 1. 7.5 rounds to 8 and saturates at 7; 2.5 and 1.5 tie → 2.
    q = F.quantize(torch.tensor([[7.5, 2.5, 1.5, -0.5, 0.0, 0.0, 0.0, 0.0]]), "int4", group_size=4)
    assert F.int4.unpack(q).tolist() == [[7, 2, 2, 0, 0, 0, 0, 0]]
    assert F.dequantize(q).tolist() == [[7.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]]  # the zero group stays zero
    assert q.data.numel() == 4 and q.scales[0].shape == (1, 2)  # 8 values in 4 bytes, one scale per group
    assert roundtrip([[-7.5, 3.0, 1.0, 0.0]], "int4", 4) == [[-8.0, 3.0, 1.0, 0.0]]  # -7.5 → -8, inside [-8, 7]
    with pytest.raises(QuantizationError, match="group size 128 does not divide the input dimension 96"):
        F.quantize(torch.ones(4, 96), "int4")


# ---- every format ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
def test_non_finite_input_is_refused(fmt):
    for bad in (float("nan"), float("inf")):
        x = torch.ones(128, 128)
        x[3, 5] = bad
        with pytest.raises(QuantizationError, match="layers.0.q.weight holds NaN or infinite"):
            F.quantize(x, fmt, name="layers.0.q.weight")


@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
def test_zero_and_all_equal_tensors(fmt):
    assert torch.equal(F.fake_quantize(torch.zeros(128, 128), fmt), torch.zeros(128, 128))
    half = torch.zeros(128, 128)
    half[:, :64] = 1.0  # zero blocks beside non-zero ones
    # INT4's symmetric mapping puts amax at 7.5 steps, which saturates at 7: an all-equal group comes back at 7/7.5
    top = 7 / 7.5 if fmt == "int4" else 1.0
    assert F.fake_quantize(half, fmt) == pytest.approx(half * top, abs=1e-6)
    equal = torch.full((128, 128), 0.37)
    assert F.fake_quantize(equal, fmt) == pytest.approx(equal, rel=0.07)  # one value per block: near its grid


# Relative Frobenius error of the round trip on N(0, 1) weights, measured ≈ fp8 0.027, mxfp8 0.029,
# nvfp4 0.095, int4 (group 128) 0.111; the bounds leave room for the seed.
BOUNDS = {"fp8": 0.035, "fp8_block": 0.035, "mxfp8": 0.04, "nvfp4": 0.12, "int4": 0.14}


@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
def test_roundtrip_error_bound(fmt):
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    q = F.quantize(x, fmt)
    err = float((F.dequantize(q) - x).norm() / x.norm())
    assert 0 < err < BOUNDS[fmt]
    assert q.nbytes < x.numel() * 2  # smaller than the same weights in bf16
    assert F.fake_quantize(x.to(torch.bfloat16), fmt).dtype == torch.bfloat16


def test_which_weights_are_quantized():
    linear = [
        "model.layers.0.self_attn.q_proj.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "layers.2.attention.wq.weight",
    ]
    other = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "output.weight",
        "tok_embeddings.weight",
        "model.layers.0.mlp.gate.weight",
        "decoder.final_layernorm.weight",
    ]
    assert all(F.quantizable(n, (64, 64)) for n in linear)
    assert not any(F.quantizable(n, (64, 64)) for n in other)
    assert not F.quantizable("model.layers.0.input_layernorm.weight", (64,))
