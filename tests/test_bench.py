"""The benchmarks run (shortened) and report every row; their speed goals are read, not asserted."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.sglang]


def run_bench(script: str, tmp_path: Path) -> str:
    pytest.importorskip("sglang", reason="SGLang is not installed")
    out = tmp_path / "report.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out.read_text()


def test_rollout_throughput_bench_reports_both_ratios(tmp_path):
    report = run_bench("rollout_throughput.py", tmp_path)
    for path in ("raw SGLang", "over the sglang engine", "in-process hf engine"):
        row = next(line for line in report.splitlines() if path in line)
        assert float(row.split("|")[2].replace(",", "")) > 0, row
    assert re.search(r"Miles / raw SGLang: \*\*\d+\.\d+\*\*", report)
    assert re.search(r"sglang engine / hf engine .*\*\*\d+\.\d+\*\*", report)


def test_weight_update_bench_covers_every_transport(tmp_path):
    report = run_bench("weight_update.py", tmp_path)
    rows = [line.split("|")[1:-1] for line in report.splitlines() if line.startswith("| 4 MB")]
    assert sorted(r[1].strip() for r in rows) == ["broadcast", "disk", "tensor"]
    for row in rows:
        latency, memcpy, ratio = float(row[3]), float(row[6]), float(row[7])
        assert latency > 0 and memcpy > 0 and ratio > 0
