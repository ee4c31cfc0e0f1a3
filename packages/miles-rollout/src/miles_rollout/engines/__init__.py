"""Engine factory: the only place that branches on the engine type."""

from __future__ import annotations

from pathlib import Path

from miles_rollout.config import HFEngineConfig, SGLangEngineConfig
from miles_rollout.protocol import RolloutEngine


def build_engine(config: HFEngineConfig | SGLangEngineConfig, model_path: str | Path, seed: int = 0) -> RolloutEngine:
    if config.type == "hf":
        from miles_rollout.engines.hf import HFEngine

        return HFEngine(model_path, config, seed=seed)
    if config.type == "sglang":
        from miles_rollout.engines.sglang.engine import SGLangEngine

        return SGLangEngine(model_path, config, seed=seed)
    raise ValueError(f"unknown rollout engine {config.type!r}")
