"""The code reward's sandbox: executions per second for each pool size, and the cost of one execution against a
bare `python -c` of the same program (no isolation, no limits), measured side by side in one run.

    .venv/bin/python bench/sandbox.py                 # 200 executions per pool size, pools of 1, 2, 4
    .venv/bin/python bench/sandbox.py --n 20 --pools 1 2   # a smoke run (tests/test_bench.py)

The program is a small solution read from stdin and checked against its expected output, the shape of a
stdin/stdout test case. Numbers depend on the machine: the ratios are what carry over.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def bare(n: int) -> list[float]:
    """Seconds of each of `n` bare runs (the same interpreter, flags and program; no sandbox)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        out = subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", PROGRAM], input="2 3\n", capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        times.append(time.perf_counter() - start)
        assert out.strip() == "5"
    return times


def pooled(n: int, workers: int, tool: str) -> tuple[float, list[float]]:
    """(executions per second, seconds of each) for `n` executions on a pool of `workers`."""
    from miles_rollout.sandbox import Outcome, Sandbox

    box = Sandbox(tool, workers=workers, queue=n)
    try:
        start = time.perf_counter()
        futures = [box.submit(PROGRAM, "2 3\n", "5") for _ in range(n)]
        runs = [f.result() for f in futures]
        wall = time.perf_counter() - start
    finally:
        box.close()
    assert all(r.outcome is Outcome.PASSED for r in runs), [r for r in runs if r.outcome is not Outcome.PASSED][:2]
    return n / wall, [r.seconds for r in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="executions per pool size")
    parser.add_argument("--pools", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, help="also write the report here (Markdown)")
    args = parser.parse_args()
    base = bare(args.n)
    base_mean = statistics.mean(base)
    rows = [["bare python -c", 1, round(1 / base_mean, 1), round(base_mean * 1000, 1), 1.0]]
    for tool in ("none", "bwrap"):
        for workers in args.pools:
            rate, each = pooled(args.n, workers, tool)
            mean = statistics.mean(each)
            rows.append([f"sandbox, tool {tool}", workers, round(rate, 1), round(mean * 1000, 1), round(mean / base_mean, 2)])  # fmt: skip
    report = (
        f"{args.n} executions of a stdin/stdout test case per row on {len(__import__('os').sched_getaffinity(0))} "
        "cores.\n\n" + table(["run", "workers", "executions/s", "ms per execution", "× bare"], rows)
    )
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
