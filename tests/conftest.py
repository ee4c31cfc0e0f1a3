"""Test tiers that stay out of the default run, which CI makes (it must end well within CI's 90 minutes):

- `real_model`: SmolLM2-135M as shipped (a conversion on first use and minutes per test); the architecture
  matrix of tiny models covers the same rules in the default run. `bash scripts/test.sh -m real_model`, or
  MILES_REAL_MODELS=1 with any selection.
- `extended`: whole runs that repeat, on another backend, transport or store, a path the default run already
  covers end to end (the backends in the loop: `tests/test_bench.py`'s trainer bench and the contract suite;
  every transport into every engine: the engine contract suite; the API on SQLite: the other control-plane
  tests). `bash scripts/test.sh -m extended`, or MILES_EXTENDED=1 with any selection.
"""

import os

import pytest

TIERS = {"real_model": ("MILES_REAL_MODELS", "real-model tier"), "extended": ("MILES_EXTENDED", "extended tier")}


def pytest_collection_modifyitems(config, items):
    selected = (config.option.markexpr or "").strip()
    for tier, (env, name) in TIERS.items():
        if os.environ.get(env) == "1" or selected == tier:
            continue
        skip = pytest.mark.skip(reason=f"{name}: run with `bash scripts/test.sh -m {tier}` or {env}=1")
        for item in items:
            if item.get_closest_marker(tier) is not None:
                item.add_marker(skip)
