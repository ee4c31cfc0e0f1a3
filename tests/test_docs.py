"""The docs site builds cleanly, its configuration reference is generated from the job spec's models, and the
README stays a user's guide: short, without dates or commit hashes (measurements live in docs/results.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# A commit hash: 7-40 lowercase hex digits with at least one digit and one letter, alone between non-word
# characters (so words such as "defaced" and numbers such as "1234567" are not taken for one).
COMMIT = re.compile(r"(?<!\w)(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?!\w)")


def test_the_docs_site_builds_strictly_with_the_generated_configuration_reference(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs tools are not installed (requirements/dev.txt)")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # without Material's notice about its successor
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    page = (site / "configuration" / "index.html").read_text(encoding="utf-8")
    assert "config-reference" not in page, "the configuration page still holds the hook's placeholder"
    for name in ("num_steps", "max_staleness", "bucket_bytes", "tensor_parallel_size", "num_samples_per_prompt"):
        assert f"<code>{name}</code>" in page, f"{name} is missing from the generated configuration reference"
    for anchor in ("job-spec", "rollout-engine-sglang", "train-backend-megatron", "sync-p2p", "schedule-fully-async"):
        assert f'id="{anchor}"' in page, f"section #{anchor} is missing from the generated configuration reference"


def test_the_readme_is_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): details belong in docs/"
    )


def test_the_readmes_links_point_at_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [m.group(1).partition("#")[0] for m in re.finditer(r"\]\(([^)\s]+)\)", text)]
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not missing, f"README.md links to files that do not exist: {missing}"


PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", PAGES)
def test_no_dates_or_commit_hashes(path: str) -> None:
    """Measurements name the command and the machine, not when or at which commit they were taken."""
    found = [
        f"{path}:{number}: {match.group()!r}"
        for number, line in enumerate((ROOT / path).read_text(encoding="utf-8").splitlines(), 1)
        for match in (*DATE.finditer(line), *COMMIT.finditer(line))
    ]
    assert not found, "dates or commit hashes:\n" + "\n".join(found)


def test_the_commit_pattern_takes_hashes_not_words() -> None:
    assert COMMIT.search("measured at 256cc1a on a loaded machine")
    assert COMMIT.search("(48331ee: 613 passed)")
    for text in ("defaced", "1234567", "a 2-core machine", "sha256", "bf16", "fp8_block", "3.5e-07", "e4m3fn"):
        assert not COMMIT.search(text), text
