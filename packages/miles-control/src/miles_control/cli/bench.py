"""`miles bench …`: benchmarks that run whole jobs (schedules, precision recipes, algorithms) or measure the
weight transports, each writing a report that is printed and stored with its runs."""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from miles_control.cli.common import Overrides, console, load_spec_or_exit

T = TypeVar("T")

BenchStore = Annotated[
    str | None,
    typer.Option(
        "--store",
        help="Store URL for the runs and the report (default: bench.db in --out); the API serving it lists the "
        "report (GET /api/v1/reports, the dashboard's Reports page).",
    ),
]
ReportFolder = Annotated[Path, typer.Option(help="Folder for report.md, the PNG plots and bench.db.")]
bench_app = typer.Typer(help="Benchmarks that run whole jobs.", no_args_is_help=True)


def _machine() -> str:
    """This machine as a report names it."""
    return f"{platform.machine()}, {os.cpu_count()} CPU cores"


def _workload(config: Path, steps: int | None, set_: list[str]):
    """The spec every run of a benchmark shares (`--steps` overriding its number of steps), or exit 2."""
    overrides = list(set_) + ([f"schedule.num_steps={steps}"] if steps else [])
    return load_spec_or_exit(config, overrides)


def _run_or_exit(run: Callable[[], T]) -> T:
    """What the benchmark's runs give, or exit 1 with why they stopped."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001
        console.print(f"[bold red]bench failed:[/] {type(exc).__name__}: {exc}", highlight=False)
        raise typer.Exit(1) from None


@bench_app.command("schedules")
def bench_schedules(
    config: Annotated[Path, typer.Argument(help="Job spec (YAML): the workload every schedule runs.")],
    out: ReportFolder = Path("bench-schedules"),
    steps: Annotated[int | None, typer.Option(min=1, help="Steps per schedule (default: the spec's).")] = None,
    store_url: BenchStore = None,
    set_: Overrides = [],  # noqa: B006
) -> None:
    """Run the same workload under sync, one_step_off and fully_async; write a report with plots."""
    spec = _workload(config, steps, set_)

    from miles_control.bench.schedules import report, run_schedules
    from miles_control.service.reports import bench_url
    from miles_control.service.store import Store

    logging.basicConfig(level=logging.WARNING)

    def on_job(schedule: str, job_id: int) -> None:
        console.print(f"{schedule}: job {job_id} done")

    summaries = _run_or_exit(lambda: run_schedules(spec, out, on_job, store_url))
    url = store_url or bench_url(out)
    store = Store(url)
    # the cores of an overlapped schedule's run (sync's stages take turns: each used every core)
    events = [e for s in summaries for e in store.events(s.job_id) if e.kind == "cpu_split"]
    split = next((e.data for e in events if e.data.get("trainer") is not None), {})
    split = {**split, "machine": _machine()}
    text = report(summaries, spec, split, out)
    _keep_report("schedules", out, text, [s.job_id for s in summaries], url)


@bench_app.command("precision")
def bench_precision(
    config: Annotated[Path, typer.Argument(help="Job spec (YAML): the workload every recipe runs.")],
    out: ReportFolder = Path("bench-precision"),
    steps: Annotated[int | None, typer.Option(min=1, help="Steps per recipe (default: the spec's).")] = None,
    recipes: Annotated[
        str | None, typer.Option(help="Comma-separated recipe names (default: all; see the report for their names).")
    ] = None,
    quick: Annotated[bool, typer.Option(help="fp32, bf16, int4 rollout with and without int4 training only.")] = False,
    store_url: BenchStore = None,
    set_: Overrides = [],  # noqa: B006
) -> None:
    """Run the same workload under each precision recipe (fp32, bf16, fp16, each rollout format with and without
    the matching training quantization); write a report of mismatch, push bytes and time, reward and accuracy."""
    spec = _workload(config, steps, set_)

    from miles_control.bench.precision import QUICK, RECIPES, report, run_recipes
    from miles_control.service.reports import bench_url

    logging.basicConfig(level=logging.WARNING)
    names = tuple(n.strip() for n in recipes.split(",")) if recipes else (QUICK if quick else tuple(RECIPES))

    def on_job(name: str, result) -> None:
        console.print(f"{name}: " + (f"refused ({result.refused})" if result.refused else "done"), highlight=False)

    results = _run_or_exit(lambda: run_recipes(spec, out, names, on_job, store_url))
    text = report(results, spec, _machine(), out)
    ran = [r.summary.job_id for r in results if r.summary is not None]
    _keep_report("precision", out, text, ran, store_url or bench_url(out))


@bench_app.command("algorithms")
def bench_algorithms(
    config: Annotated[Path, typer.Argument(help="Job spec (YAML): the workload every algorithm runs.")],
    out: ReportFolder = Path("bench-algorithms"),
    steps: Annotated[int | None, typer.Option(min=1, help="Steps per algorithm (default: the spec's).")] = None,
    algorithms: Annotated[
        str | None,
        typer.Option(help="Comma-separated names: built-ins or dotted paths (default: every built-in RL objective)."),
    ] = None,
    store_url: BenchStore = None,
    set_: Overrides = [],  # noqa: B006
) -> None:
    """Run the same workload under each algorithm (train.algorithm); write a report of held-out accuracy and reward
    against steps and wall time, step time, and tokens generated per token trained."""
    spec = _workload(config, steps, set_)

    from miles_control.bench.algorithms import report, run_algorithms
    from miles_control.service.reports import bench_url
    from miles_train.config import RL_ALGORITHMS, AlgorithmConfig

    logging.basicConfig(level=logging.WARNING)
    names = tuple(n.strip() for n in algorithms.split(",") if n.strip()) if algorithms else RL_ALGORITHMS
    for name in names:
        try:
            AlgorithmConfig(name=name)
        except ValueError as exc:
            console.print(f"[bold red]error:[/] --algorithms: {exc}", highlight=False)
            raise typer.Exit(2) from None

    def on_job(name: str, job_id: int) -> None:
        console.print(f"{name}: job {job_id} done", highlight=False)

    results = _run_or_exit(lambda: run_algorithms(spec, out, names, on_job, store_url))
    text = report(results, spec, _machine(), out)
    _keep_report("algorithms", out, text, [r.summary.job_id for r in results], store_url or bench_url(out))


@bench_app.command("weights")
def bench_weights(
    out: Annotated[Path, typer.Option(help="Folder for report.md.")] = Path("bench-weights"),
    quick: Annotated[bool, typer.Option(help="4 and 16 MB with 1 and 4 MB buckets, 2 pushes each (CI).")] = False,
    transports: Annotated[
        str, typer.Option(help="Comma-separated: disk, tensor, broadcast, p2p.")
    ] = "disk,tensor,broadcast,p2p",
    params: Annotated[float, typer.Option(min=1, help="Projection: number of parameters.")] = 1e12,
    bytes_per_param: Annotated[float, typer.Option(min=0.25, help="Projection: bytes each (2: bf16).")] = 2.0,
    senders: Annotated[
        int,
        typer.Option(
            min=1, help="Projection: trainer ranks sending at once (p2p; the other transports send from rank 0)."
        ),
    ] = 1,
    engines: Annotated[int, typer.Option(min=1, help="Projection: engines receiving.")] = 8,
    link_gb_s: Annotated[float, typer.Option(min=0.001, help="Projection: GB/s of each sender's link.")] = 50.0,
    bucket_mb: Annotated[int, typer.Option(min=1, help="Projection: bucket size in MiB.")] = 1024,
    store_url: BenchStore = None,
) -> None:
    """Measure each transport's fixed, per-bucket and per-byte cost here; project an update's time at scale."""
    from miles_control.bench.weights import TRANSPORTS, Scale, fit, measure, memcpy_seconds_per_byte, report

    names = [t.strip() for t in transports.split(",") if t.strip()]
    unknown = [t for t in names if t not in TRANSPORTS]
    if unknown or not names:
        console.print(f"[bold red]error:[/] --transports: {unknown or names} not in {', '.join(TRANSPORTS)}")
        raise typer.Exit(2)
    sizes, buckets, repeats = ((4, 16), (1, 4), 2) if quick else ((16, 64, 256), (4, 64), 3)
    scale = Scale(params, bytes_per_param, senders, engines, link_gb_s, bucket_mb << 20)

    def on_point(p) -> None:
        console.print(f"{p.transport}: {p.num_bytes >> 20} MB in {p.num_buckets} bucket(s): {p.seconds * 1000:.1f} ms")

    points = measure(sizes, buckets, names, repeats, on_point)
    text = report(points, fit(points), memcpy_seconds_per_byte(64 << 20), scale, _machine())
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    from miles_control.service.reports import bench_url

    _keep_report("weights", out, text, [], store_url or bench_url(out))


def _keep_report(kind: str, out: Path, text: str, job_ids: list[int], url: str) -> None:
    """Print the report and store it with its runs (report.md and the plots stay in --out)."""
    from miles_control.service.reports import save_report

    console.print(text, markup=False, highlight=False)
    [report_id] = save_report(kind, out, text, job_ids, [url])
    from sqlalchemy.engine import make_url

    shown = make_url(url).render_as_string(hide_password=True)  # a PostgreSQL password is not printed
    # one line however narrow the terminal (or none, in a log): paths are copied from it
    console.print(
        f"report: {out / 'report.md'}; stored as report {report_id} in {shown}", highlight=False, soft_wrap=True
    )


def register(app: typer.Typer) -> None:
    """Add `miles bench …` to the `miles` command line."""
    app.add_typer(bench_app, name="bench")
