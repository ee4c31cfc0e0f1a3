"""miles-dashboard deploys on its own: its wheel, installed by pip into a fresh venv that holds nothing but what it
declares (miles-control without extras: the API client and schemas), serves its sign-in page, has its command, and
has no torch, Ray or the rest of Miles to import.

The venv is made without downloading: its site-packages links the installed files of exactly the third-party
distributions the two wheels require (transitively, from this environment's metadata); then pip installs the two
wheels from a local folder with dependency resolution on (`--no-index`), so a dependency the wheels forgot to
declare, or one declared but absent, fails the install or the checks below."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles_control.testing.servers import fresh_venv, link_distributions, requirement_closure

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
OURS = {"miles-dashboard", "miles-control"}


SIGN_IN = """
import importlib.util, json, sys
from streamlit.testing.v1 import AppTest
import miles_control, miles_dashboard
at = AppTest.from_file(str(miles_dashboard.APP), default_timeout=60).run()
print(json.dumps({
    "exceptions": [e.message for e in at.exception],
    "info": [i.value for i in at.info],
    "fields": [t.label for t in at.text_input],
    "loaded": [m for m in ("torch", "ray", "transformers", "sqlalchemy", "fastapi", "miles_rollout") if m in sys.modules],
    "findable": [m for m in ("torch", "ray", "miles_sync", "miles_rollout", "miles_train") if importlib.util.find_spec(m)],
    "origins": [miles_control.__file__, miles_dashboard.__file__],
}))
"""


def test_the_dashboard_wheel_alone_in_a_fresh_venv(tmp_path):
    # Built from copies without the trees' build/ folders: setuptools would reuse what they hold, so a module
    # deleted from the source could still ship and this test not see it.
    sources = []
    for project in (ROOT / "packages" / "miles-control", ROOT / "apps" / "dashboard"):
        sources.append(tmp_path / "src" / project.name)
        shutil.copytree(project, sources[-1], ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
         *map(str, sources)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    venv = tmp_path / "venv"
    python, site = fresh_venv(venv, with_pip=True)  # its pip resolves the dependencies below
    third_party = requirement_closure(["miles-dashboard"]) - OURS
    assert not third_party & {"torch", "ray", "transformers", "sqlalchemy", "miles-sync", "miles-rollout"}, third_party
    link_distributions(third_party, site)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_FIND_LINKS")}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
         "--find-links", str(wheels), "miles-dashboard"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    outside = tmp_path / "elsewhere"
    outside.mkdir()

    helped = subprocess.run([str(venv / "bin" / "miles-dashboard"), "--help"], cwd=outside, env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert helped.returncode == 0 and "--api" in helped.stdout, helped.stdout + helped.stderr
    refused = subprocess.run([str(venv / "bin" / "miles-dashboard"), "--port", "http"], cwd=outside, env=env,
                             capture_output=True, text=True)  # fmt: skip
    assert refused.returncode == 2 and "--port" in refused.stderr, refused.stderr

    # the sign-in page, with no token and no API behind the URL: it asks for a token and calls nothing
    page = subprocess.run([str(python), "-c", SIGN_IN], cwd=outside, capture_output=True, text=True, timeout=300,
                          env={**env, "MILES_API_URL": "http://127.0.0.1:9"})  # fmt: skip
    assert page.returncode == 0, page.stdout[-2000:] + page.stderr[-4000:]
    shown = json.loads(page.stdout.strip().splitlines()[-1])
    assert not shown["exceptions"], shown
    assert any("Sign in with your token" in text for text in shown["info"]), shown
    assert {"API URL", "Token"} <= set(shown["fields"]), shown
    assert shown["loaded"] == [] and shown["findable"] == [], shown  # no torch, Ray or trainer anywhere
    assert all(origin.startswith(str(site)) for origin in shown["origins"]), shown  # the wheels, not the tree

    # the `miles` command that miles-control installs says what it needs instead of a traceback
    cli = subprocess.run([str(venv / "bin" / "miles"), "--help"], cwd=outside, env=env, capture_output=True, text=True)
    assert cli.returncode == 2 and 'pip install "miles-control[full]"' in cli.stderr, cli.stderr
