"""Rollout configuration defaults and errors."""

import importlib.util

import pytest
from pydantic import ValidationError

from miles_rollout import config as rollout_config
from miles_rollout.config import RolloutConfig


def test_default_engine_is_sglang_where_installed_else_hf(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real(name))
    assert RolloutConfig().engine.type == "sglang"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name))
    assert RolloutConfig().engine.type == "hf"
    assert rollout_config.default_engine().type == "hf"


def test_an_explicit_engine_wins_and_unknown_fields_are_named():
    assert RolloutConfig.model_validate({"engine": {"type": "hf"}}).engine.type == "hf"
    with pytest.raises(ValidationError, match="engine.sglang.num_engine"):
        RolloutConfig.model_validate({"engine": {"type": "sglang", "num_engine": 2}})
    with pytest.raises(ValidationError, match="max_requests_per_call"):
        RolloutConfig.model_validate({"engine": {"type": "sglang", "max_requests_per_call": 0}})
