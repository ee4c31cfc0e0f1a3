"""REST API latency under 100 concurrent clients on loopback, and the store's metric ingestion rate.

A real `miles serve` process (launcher off) on a store seeded with jobs, metrics and spans. Each client
sends a dashboard's mix of reads (job list, one job, a metric curve, the spans of a step range, events)
one after another: with `--think-ms` pauses, as dashboards poll (the goal: p99 < 50 ms, no errors), and
closed-loop (no pause: the server's saturation throughput). Clients and server share this machine.

Ingestion: metric points per second written the way a job's driver writes them (one transaction per
step with all of its metrics), on SQLite and, when MILES_TEST_PG_URL is set, PostgreSQL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table  # noqa: E402

from miles_control.service.store import JobStatus, Store  # noqa: E402
from miles_control.service.store.tokens import create_token  # noqa: E402
from miles_control.testing.servers import PG_ENV, ApiServer, fresh_pg_database  # noqa: E402

GOAL_P99_MS = 50.0


def seed(store: Store, num_jobs: int, num_steps: int) -> list[int]:
    """Jobs like finished runs: per step 30 metrics, 4 spans, a step row; a few events."""
    ids = []
    for j in range(num_jobs):
        job = store.create_job(f"bench-{j}", {"name": f"bench-{j}", "schedule": {"num_steps": num_steps}})
        ids.append(job)
        if j >= 3:  # the first three stay small: a job list has both
            continue
        store.set_status(job, JobStatus.STARTING)
        store.set_status(job, JobStatus.RUNNING)
        for step in range(1, num_steps + 1):
            store.add_metrics(job, step, {f"m/{k}": random.random() for k in range(30)})
            t = float(step)
            store.add_spans(
                job,
                [dict(stage=s, step=step, worker="w", start=t + i, end=t + i + 0.5) for i, s in
                 enumerate(("rollout", "reward", "train", "weight_sync"))],
            )  # fmt: skip
            store.add_step(job, step, step, t, t + 4)
        store.set_status(job, JobStatus.SUCCEEDED)
    return ids


async def load(url: str, token: str, jobs: list[int], clients: int, duration: float, think_s: float) -> dict:
    import httpx

    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + duration
    busy = jobs[:3]

    def request(rng: random.Random) -> tuple[str, dict]:
        job = rng.choice(busy)
        lo = rng.randint(1, 150)
        return rng.choice(
            [
                ("/api/v1/jobs", {"limit": 20}),
                (f"/api/v1/jobs/{rng.choice(jobs)}", {}),
                (f"/api/v1/jobs/{job}/metrics", {"name": f"m/{rng.randint(0, 29)}"}),
                (f"/api/v1/jobs/{job}/spans", {"step_min": lo, "step_max": lo + 20}),
                (f"/api/v1/jobs/{job}/events", {}),
            ]
        )

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal errors
        rng = random.Random(i)
        await asyncio.sleep(rng.random() * max(think_s, 0.05))  # spread the start
        while time.perf_counter() < deadline:
            path, params = request(rng)
            start = time.perf_counter()
            try:
                response = await http.get(path, params=params)
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - start)
            errors += not ok
            if think_s:
                await asyncio.sleep(think_s * (0.5 + rng.random()))

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        wall = time.perf_counter() - started
    latencies.sort()
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "requests": len(latencies),
        "errors": errors,
        "rps": len(latencies) / wall,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
        "max_ms": latencies[-1] * 1000,
    }


def ingestion(url: str, num_steps: int, metrics_per_step: int = 30) -> float:
    store = Store(url)
    job = store.create_job("ingest", {})
    start = time.perf_counter()
    for step in range(num_steps):
        store.add_metrics(job, step, {f"m/{k}": float(k) for k in range(metrics_per_step)})
    rate = num_steps * metrics_per_step / (time.perf_counter() - start)
    store.engine.dispose()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds per load phase.")
    parser.add_argument("--think-ms", type=float, default=1000.0, help="Mean pause between a client's requests.")
    parser.add_argument("--steps", type=int, default=200, help="Steps of each seeded job.")
    parser.add_argument("--quick", action="store_true", help="A smoke run: 10 clients, 2 s, small store.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.clients, args.duration, args.steps = 10, 2.0, 20

    lines = ["# API latency and metric ingestion", ""]
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        store = Store(url)
        jobs = seed(store, 20, args.steps)
        _, token = create_token(store, "bench", "read")
        server = ApiServer(url, Path(tmp), launcher="off").start()
        rows = []
        try:
            for label, think in (
                (f"polling, {args.think_ms:g} ms think time", args.think_ms / 1000),
                ("closed loop", 0),
            ):
                r = asyncio.run(load(server.url, token, jobs, args.clients, args.duration, think))
                rows.append([label, args.clients, r["requests"], r["errors"], r["rps"], r["p50_ms"], r["p99_ms"],
                             r["max_ms"]])  # fmt: skip
                print(f"{label}: {r}", file=sys.stderr)
        finally:
            server.stop()
        header = ["load", "clients", "requests", "errors", "req/s", "p50 ms", "p99 ms", "max ms"]
        lines += [f"Store: SQLite, {args.steps} steps × 30 metrics in 3 of 20 jobs. Server: one uvicorn process.", ""]
        lines += [table(header, rows), ""]
        polling = rows[0]
        verdict = "met" if polling[6] < GOAL_P99_MS and polling[3] == 0 else "NOT met"
        lines += [f"Goal p99 < {GOAL_P99_MS:g} ms with no errors at {args.clients} polling clients: **{verdict}** "
                  f"(p99 {polling[6]:.1f} ms, {polling[3]} errors).", ""]  # fmt: skip

        num = 40 if args.quick else 400
        ingest_rows = [["SQLite (WAL)", ingestion(f"sqlite:///{tmp}/ingest.db", num)]]
        if os.environ.get(PG_ENV):
            with fresh_pg_database(os.environ[PG_ENV]) as pg:
                ingest_rows.append(["PostgreSQL", ingestion(pg, num)])
        else:
            ingest_rows.append(["PostgreSQL", f"skipped: set {PG_ENV}"])
        lines += [f"Metric ingestion, one transaction per step of 30 metrics ({num} steps):", ""]
        lines += [table(["store", "metric points/s"], ingest_rows)]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)
    with contextlib.suppress(Exception):
        store.engine.dispose()


if __name__ == "__main__":
    main()
