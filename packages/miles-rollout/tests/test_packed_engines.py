"""Engines and packed pushes (`sync.quant_wire: packed`): only SGLang on a GPU serves them; everything else refuses
them plainly, before a server starts or a weight is touched. The GPU path itself is not run here (no GPU)."""

from __future__ import annotations

import pytest
import torch

from miles_rollout import build_engine
from miles_rollout.config import HFEngineConfig, SGLangEngineConfig
from miles_rollout.engines.sglang.server import EngineStartError
from miles_rollout.engines.sglang.weights import WeightLoader
from miles_sync import InprocHandle, WeightHandle


def handle(packed: str | None) -> WeightHandle:
    return InprocHandle(
        weight_version=2,
        num_tensors=1,
        num_bytes=4,
        num_buckets=1,
        fingerprint="f",
        buckets=[[("w", torch.zeros(1))]],
        packed=packed,
    )


def test_the_hf_engine_refuses_packed_pushes(tiny_model_dir):
    with pytest.raises(ValueError, match="packed needs rollout.engine.type: sglang"):
        build_engine(HFEngineConfig(), tiny_model_dir, packed="fp8_block")
    engine = build_engine(HFEngineConfig(), tiny_model_dir)
    before = engine.weight_fingerprint()
    with pytest.raises(ValueError, match="carries packed fp8_block weights, which only SGLang on a GPU loads"):
        engine.receive(handle("fp8_block"))
    assert engine.weight_fingerprint() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_sglang_refuses_packed_weights_without_a_gpu_before_launching(tiny_model_dir, tmp_path):
    config = SGLangEngineConfig(type="sglang", log_dir=str(tmp_path))
    with pytest.raises(EngineStartError, match="need a GPU"):
        build_engine(config, tiny_model_dir, packed="fp8_block")
    assert not list(tmp_path.glob("sglang-*.log"))  # no server was started


def test_a_push_in_the_other_wire_layout_is_refused_before_loading():
    initial = [("w", torch.zeros(1))]
    values = WeightLoader("sglang", [], None, "float32", initial)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="carries packed fp8_block weights but the servers hold plain-value weights"):
        values._accept(handle("fp8_block"), initial)
    packed = WeightLoader("sglang", [], None, "float32", initial, packed="fp8_block")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="carries plain-value weights but the servers hold packed fp8_block"):
        packed._accept(handle(None), initial)
