"""bench/api_latency.py runs (shortened) and reports every row; its p99 goal is read, not asserted."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_latency_bench_reports_latency_and_ingestion(tmp_path):
    out = tmp_path / "report.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "api_latency.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = out.read_text()
    for load in ("polling", "closed loop"):
        row = next(line for line in report.splitlines() if line.startswith(f"| {load}")).split("|")[1:-1]
        requests, errors, p50, p99 = int(row[2]), int(row[3]), float(row[5]), float(row[6])
        assert requests > 0 and errors == 0 and 0 < p50 <= p99, row
    assert re.search(r"Goal p99 < 50 ms with no errors at 10 polling clients: \*\*(met|NOT met)\*\*", report)
    sqlite_rate = next(line for line in report.splitlines() if line.startswith("| SQLite"))
    assert float(sqlite_rate.split("|")[2].replace(",", "")) > 0
