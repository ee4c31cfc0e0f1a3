"""miles-rollout and miles-train each work alone, outside this repository: the examples of
`examples/standalone/` run in a fresh venv that holds only that package (built and installed as a
wheel, not from the source tree), miles-sync, and their declared dependencies.

The venv is made without copying gigabytes: its site-packages links the files of exactly the
distributions the package requires (transitively, from their installed metadata) from the project's
environment. Anything undeclared (Ray, miles-control, the other package) is absent, so an import of it
fails the example, and the example runs from a folder outside the repository."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles_control.testing.servers import fresh_venv, link_distributions, requirement_closure

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random two-layer Llama with tied embeddings and the arithmetic character tokenizer."""
    from miles_control.testing import tiny_models
    from miles_rollout.tasks.arithmetic import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = tiny_models.tiny_model("llama", tokenizer=tokenizer, tie_word_embeddings=True, max_position_embeddings=64)
    return tiny_models.save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), config, tokenizer=tokenizer)


@pytest.mark.parametrize(
    ("package", "example", "expect"),
    [
        ("miles-rollout", "rollout_alone.py", r"samples: 8 in 2 groups"),
        ("miles-train", "train_alone.py", r"exported \d+ tensors, e\.g\. model\."),
    ],
)
def test_a_package_alone_runs_its_example_outside_the_repository(tmp_path, tiny_model, package, example, expect):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
         str(ROOT / "packages" / "miles-sync"), str(ROOT / "packages" / package)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    venv = tmp_path / "venv"
    python, site = fresh_venv(venv, with_pip=False)
    ours = {"miles-sync", package}
    link_distributions(requirement_closure([package]) - ours, site)
    # Install the two wheels with this environment's pip into the venv's site-packages (non-editable copies).
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
         *map(str, sorted(wheels.glob("*.whl")))],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u, json; print(json.dumps({m: (u.find_spec(m) or None) and "
         "u.find_spec(m).origin for m in ('miles_control', 'miles_train', 'miles_rollout', 'miles_sync', 'ray')}))"],
        cwd=outside, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = {name: origin for name, origin in json.loads(probe.stdout).items() if origin}
    own = package.replace("-", "_")
    assert sorted(found) == sorted({own, "miles_sync"}), found  # no Ray, no miles-control, not the other package
    assert all(origin.startswith(str(site)) for origin in found.values()), found  # the wheels, not the source tree
    result = subprocess.run(
        [str(python), str(ROOT / "examples" / "standalone" / example), str(tiny_model)],
        cwd=outside, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    print(result.stdout)
    assert re.search(expect, result.stdout), result.stdout
