"""Test tiers. The `real_model` tier (SmolLM2-135M as shipped: a conversion on first use and minutes per test)
stays out of the default run, which CI makes; `bash scripts/test.sh -m real_model` runs it (as does
MILES_REAL_MODELS=1 with any selection). The architecture matrix of tiny models covers the same rules in
the default run."""

import os

import pytest

TIER_ENV = "MILES_REAL_MODELS"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(TIER_ENV) == "1" or (config.option.markexpr or "").strip() == "real_model":
        return
    skip = pytest.mark.skip(reason=f"real-model tier: run with `bash scripts/test.sh -m real_model` or {TIER_ENV}=1")
    for item in items:
        if item.get_closest_marker("real_model") is not None:
            item.add_marker(skip)
