"""Test tiers that stay out of the default run, which CI makes (it should end within ~30-45 minutes: CI's limit
is 90). The default run checks every feature end to end at least once, at the smallest size that can still fail;
the tiers hold what repeats a covered path or only makes a check longer.

- `real_model`: SmolLM2-135M as shipped (a conversion on first use and minutes per test); the architecture
  matrix of tiny models covers the same rules in the default run. `bash scripts/test.sh -m real_model`, or
  MILES_REAL_MODELS=1 with any selection.
- `extended`: whole runs that repeat, on another backend, transport, store, engine or CPU kernel, a path the
  default run already covers end to end, and the longer learning runs. Each marked test says what covers it. `bash
  scripts/test.sh -m extended`, or MILES_EXTENDED=1 with any selection. Run it before resolving an issue that
  touches one of its paths.
"""

import os
import re

import pytest

TIERS = {"real_model": ("MILES_REAL_MODELS", "real-model tier"), "extended": ("MILES_EXTENDED", "extended tier")}


@pytest.hookimpl(trylast=True)  # after the packages' conftests mark their items
def pytest_collection_modifyitems(config, items):
    selected = (config.option.markexpr or "").strip()
    for tier, (env, name) in TIERS.items():
        if os.environ.get(env) == "1" or re.search(rf"(?<!not )\b{tier}\b", selected):  # e.g. -m "extended and sglang"
            continue
        skip = pytest.mark.skip(reason=f"{name}: run with `bash scripts/test.sh -m {tier}` or {env}=1")
        for item in items:
            if item.get_closest_marker(tier) is not None:
                item.add_marker(skip)
