"""`miles` command line. Specs are validated before torch or Ray are imported."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from miles_control.cli_control import register as register_control_commands
from miles_control.config import DEFAULT_STORE_URL
from miles_control.spec import SpecError, load_spec

app = typer.Typer(
    help="Miles: RL post-training with separate rollout and training, measured stage by stage.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """Miles command line."""


def load_spec_or_exit(config: Path, overrides: list[str]):
    """The validated spec, or exit 2 with one line per problem (naming the field) before anything loads."""
    try:
        return load_spec(config, overrides)
    except SpecError as exc:
        console.print(f"[bold red]error:[/] invalid job spec [bold]{exc.source}[/]")
        for line in exc.errors:
            console.print(f"  {line}", markup=False, highlight=False)
        raise typer.Exit(2) from None


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="Job spec (YAML).")],
    set_: Annotated[list[str], typer.Option("--set", help="Override a field: path.to.field=value (repeatable).")] = [],  # noqa: B006
    quiet: Annotated[bool, typer.Option(help="No progress: only held-out accuracy lines.")] = False,
    log_every: Annotated[
        int, typer.Option(min=1, help="Without a terminal (a log file, CI, nohup): a plain line every N steps.")
    ] = 10,
) -> None:
    """Run a job to the end, with live progress and a per-stage timing table.

    On a terminal, a progress bar; without one, a plain progress line every `--log-every` steps (and at each
    phase, evaluation and the last step), which a log file keeps readable."""
    spec = load_spec_or_exit(config, set_)

    from miles_control.run import run_job
    from miles_control.store import Store

    logging.basicConfig(level=logging.WARNING)
    store = Store(spec.store.url)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        disable=quiet or not console.is_terminal,
    )
    plain = not quiet and not console.is_terminal
    started = time.monotonic()
    task = progress.add_task("starting", total=spec.schedule.num_steps, status="")
    last_eval = {"value": None}

    def on_phase(phase: str) -> None:
        progress.update(task, description=phase)
        if plain:
            console.print(f"[{time.monotonic() - started:6.0f} s] {phase}", markup=False, highlight=False)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if "eval/accuracy" in metrics:
            last_eval["value"] = metrics["eval/accuracy"]
        acc = "-" if last_eval["value"] is None else f"{last_eval['value']:.3f}"
        # kind: sft has no reward worth showing (its samples are the labels)
        reward = "" if spec.kind == "sft" else f"reward {metrics['rollout/reward_mean']:.3f}  "
        progress.update(
            task,
            completed=step,
            description="training",
            status=(
                f"{reward}eval acc {acc}  loss {metrics['train/loss']:+.4f}  entropy {metrics['train/entropy']:.3f}"
            ),
        )
        if quiet and "eval/accuracy" in metrics:
            console.print(f"step {step}: eval accuracy {metrics['eval/accuracy']:.3f}")
        elif plain and (step % log_every == 0 or step == spec.schedule.num_steps or "eval/accuracy" in metrics):
            console.print(
                f"[{time.monotonic() - started:6.0f} s] step {step}/{spec.schedule.num_steps}  "
                f"{reward}eval acc {acc}  loss {metrics['train/loss']:+.4f}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    job_id = None
    try:
        with progress:
            # Plug-in modules (a reward by dotted path) may sit beside the job file.
            job_id = run_job(spec, on_phase=on_phase, on_step=on_step, store=store, plugin_dirs=[config.parent])
    except Exception as exc:  # the job row already holds the reason
        from miles_control.preflight import describe_error

        console.print(f"[bold red]job failed:[/] {escape(describe_error(exc))}", highlight=False)
        raise typer.Exit(1) from None
    print_summary(store, job_id)


@app.command()
def export(
    job_or_checkpoint: Annotated[
        str,
        typer.Argument(metavar="JOB_OR_CHECKPOINT", help="A job id (its newest checkpoint) or a checkpoint folder."),
    ],
    out: Annotated[Path, typer.Argument(help="The HF folder to write (must not exist, or be empty).")],
    dtype: Annotated[
        str, typer.Option(help="auto (the model's own dtype, from its config), float32, bfloat16 or float16.")
    ] = "auto",
    step: Annotated[int | None, typer.Option(help="With a job id: the checkpoint of this step.")] = None,
    model: Annotated[
        Path | None, typer.Option(help="The model folder whose tokenizer to include; a job id finds its own.")
    ] = None,
    store: Annotated[str, typer.Option(help="The job store (with a job id).")] = DEFAULT_STORE_URL,
) -> None:
    """Write a trained policy as a Hugging Face model folder (config, safetensors, tokenizer with its chat template,
    generation config), from a checkpoint of any backend; it loads with `from_pretrained` and serves with SGLang."""
    from miles_control.export import ExportError, export_checkpoint, find_checkpoint

    try:
        if job_or_checkpoint.isdigit():
            checkpoint, job_model = find_checkpoint(store, int(job_or_checkpoint), step)
            model = model or job_model
        else:
            if step is not None:
                raise ExportError("--step: only with a job id")
            checkpoint = Path(job_or_checkpoint)
            if not checkpoint.is_dir():
                raise ExportError(f"JOB_OR_CHECKPOINT: {checkpoint} is neither a job id nor a checkpoint folder")
        written = export_checkpoint(checkpoint, out, model, dtype)
    except ExportError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    console.print(f"exported {checkpoint} to {written}", soft_wrap=True)


data_app = typer.Typer(help="Generate task data.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("arithmetic")
def data_arithmetic(
    out: Annotated[Path, typer.Argument(help="JSONL file to write (fields: prompt, label).")],
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=1)] = 1000,
    seed: Annotated[int, typer.Option()] = 0,
    digits: Annotated[int, typer.Option(min=1, max=6)] = 2,
    operations: Annotated[str, typer.Option(help="Any of + - * (e.g. '+-').")] = "+",
) -> None:
    """Write seeded integer-arithmetic prompts, e.g. {"prompt": "37+58=", "label": "95"}."""
    from miles_rollout.data import write_jsonl
    from miles_rollout.tasks.arithmetic import arithmetic_prompts

    bad = sorted(set(operations) - set("+-*"))
    if bad or not operations:
        console.print(f"[bold red]error:[/] --operations: {bad or 'empty'} not among + - *")
        raise typer.Exit(2)
    write_jsonl(arithmetic_prompts(num_prompts, seed, digits, tuple(operations)), out)
    console.print(f"wrote {num_prompts} prompts to {out}")


schedule_app = typer.Typer(help="Change the schedule of a running job.", no_args_is_help=True)
app.add_typer(schedule_app, name="schedule")


@schedule_app.command("set")
def schedule_set(
    job_id: Annotated[int, typer.Argument(help="The running job (its id in the store).")],
    changes: Annotated[list[str], typer.Argument(help="field=value, e.g. update_weights_interval=2.")],
    store_url: Annotated[str, typer.Option("--store", help="SQLAlchemy URL of the job store.")] = DEFAULT_STORE_URL,
) -> None:
    """Queue a change of live schedule fields; the job applies it at its next step and records it."""
    import yaml

    from miles_control.schedules.control import ScheduleChangeError, queue_schedule_change
    from miles_control.store import Store

    patch, problems = {}, []
    for item in changes:
        key, sep, value = item.partition("=")
        if not sep:
            problems.append(f"{item!r}: expected field=value")
        else:
            patch[key] = yaml.safe_load(value)
    if problems:
        for line in problems:
            console.print(f"[bold red]error:[/] {line}", highlight=False)
        raise typer.Exit(2)
    store = Store(store_url)
    try:  # the same check the API runs on PATCH /jobs/{id}/schedule
        change_id = queue_schedule_change(store, job_id, patch)
    except (KeyError, ScheduleChangeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) else str(exc)
        console.print(f"[bold red]error:[/] {message} (store {store_url})", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"queued change {change_id} for job {job_id}: {patch} (applied at its next step)")


BenchStore = Annotated[
    str | None,
    typer.Option(
        "--store",
        help="Store URL for the runs and the report (default: bench.db in --out); the API serving it lists the "
        "report (GET /api/v1/reports, the dashboard's Reports page).",
    ),
]
bench_app = typer.Typer(help="Benchmarks that run whole jobs.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("schedules")
def bench_schedules(
    config: Annotated[Path, typer.Argument(help="Job spec (YAML): the workload every schedule runs.")],
    out: Annotated[Path, typer.Option(help="Folder for report.md, the PNG plots and bench.db.")] = Path(
        "bench-schedules"
    ),
    steps: Annotated[int | None, typer.Option(min=1, help="Steps per schedule (default: the spec's).")] = None,
    store_url: BenchStore = None,
    set_: Annotated[list[str], typer.Option("--set", help="Override a field: path.to.field=value (repeatable).")] = [],  # noqa: B006
) -> None:
    """Run the same workload under sync, one_step_off and fully_async; write a report with plots."""
    overrides = list(set_) + ([f"schedule.num_steps={steps}"] if steps else [])
    spec = load_spec_or_exit(config, overrides)
    import platform

    from miles_control.bench import report, run_schedules
    from miles_control.reports import bench_url
    from miles_control.store import Store

    logging.basicConfig(level=logging.WARNING)

    def on_job(schedule: str, job_id: int) -> None:
        console.print(f"{schedule}: job {job_id} done")

    try:
        summaries = run_schedules(spec, out, on_job, store_url)
    except Exception as exc:  # noqa: BLE001
        console.print(f"[bold red]bench failed:[/] {type(exc).__name__}: {exc}", highlight=False)
        raise typer.Exit(1) from None
    url = store_url or bench_url(out)
    store = Store(url)
    split = next((e.data for e in store.events(summaries[0].job_id) if e.kind == "cpu_split"), {})
    split = {**split, "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores"}
    text = report(summaries, spec, split, out)
    _keep_report("schedules", out, text, [s.job_id for s in summaries], url)


@bench_app.command("precision")
def bench_precision(
    config: Annotated[Path, typer.Argument(help="Job spec (YAML): the workload every recipe runs.")],
    out: Annotated[Path, typer.Option(help="Folder for report.md, the PNG plots and bench.db.")] = Path(
        "bench-precision"
    ),
    steps: Annotated[int | None, typer.Option(min=1, help="Steps per recipe (default: the spec's).")] = None,
    recipes: Annotated[
        str | None, typer.Option(help="Comma-separated recipe names (default: all; see the report for their names).")
    ] = None,
    quick: Annotated[bool, typer.Option(help="fp32, bf16, int4 rollout with and without int4 training only.")] = False,
    store_url: BenchStore = None,
    set_: Annotated[list[str], typer.Option("--set", help="Override a field: path.to.field=value (repeatable).")] = [],  # noqa: B006
) -> None:
    """Run the same workload under each precision recipe (fp32, bf16, fp16, each rollout format with and without
    the matching training quantization); write a report of mismatch, push bytes and time, reward and accuracy."""
    overrides = list(set_) + ([f"schedule.num_steps={steps}"] if steps else [])
    spec = load_spec_or_exit(config, overrides)
    import platform

    from miles_control.bench_precision import QUICK, RECIPES, report, run_recipes
    from miles_control.reports import bench_url

    logging.basicConfig(level=logging.WARNING)
    names = tuple(n.strip() for n in recipes.split(",")) if recipes else (QUICK if quick else tuple(RECIPES))

    def on_job(name: str, result) -> None:
        console.print(f"{name}: " + (f"refused ({result.refused})" if result.refused else "done"), highlight=False)

    try:
        results = run_recipes(spec, out, names, on_job, store_url)
    except Exception as exc:  # noqa: BLE001
        console.print(f"[bold red]bench failed:[/] {type(exc).__name__}: {exc}", highlight=False)
        raise typer.Exit(1) from None
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores"
    text = report(results, spec, machine, out)
    ran = [r.summary.job_id for r in results if r.summary is not None]
    _keep_report("precision", out, text, ran, store_url or bench_url(out))


@bench_app.command("algorithms")
def bench_algorithms(
    config: Annotated[Path, typer.Argument(help="Job spec (YAML): the workload every algorithm runs.")],
    out: Annotated[Path, typer.Option(help="Folder for report.md, the PNG plots and bench.db.")] = Path(
        "bench-algorithms"
    ),
    steps: Annotated[int | None, typer.Option(min=1, help="Steps per algorithm (default: the spec's).")] = None,
    algorithms: Annotated[
        str | None,
        typer.Option(help="Comma-separated names: built-ins or dotted paths (default: every built-in RL objective)."),
    ] = None,
    store_url: BenchStore = None,
    set_: Annotated[list[str], typer.Option("--set", help="Override a field: path.to.field=value (repeatable).")] = [],  # noqa: B006
) -> None:
    """Run the same workload under each algorithm (train.algorithm); write a report of held-out accuracy and reward
    against steps and wall time, step time, and tokens generated per token trained."""
    overrides = list(set_) + ([f"schedule.num_steps={steps}"] if steps else [])
    spec = load_spec_or_exit(config, overrides)
    import platform

    from miles_control.bench_algorithms import report, run_algorithms
    from miles_control.reports import bench_url
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

    try:
        results = run_algorithms(spec, out, names, on_job, store_url)
    except Exception as exc:  # noqa: BLE001
        console.print(f"[bold red]bench failed:[/] {type(exc).__name__}: {exc}", highlight=False)
        raise typer.Exit(1) from None
    text = report(results, spec, f"{platform.machine()}, {os.cpu_count()} CPU cores", out)
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
    import platform

    from miles_control.bench_weights import TRANSPORTS, Scale, fit, measure, memcpy_seconds_per_byte, report

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
    text = report(points, fit(points), memcpy_seconds_per_byte(64 << 20), scale,
                  f"{platform.machine()}, {os.cpu_count()} CPU cores")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    from miles_control.reports import bench_url

    _keep_report("weights", out, text, [], store_url or bench_url(out))


def _keep_report(kind: str, out: Path, text: str, job_ids: list[int], url: str) -> None:
    """Print the report and store it with its runs (report.md and the plots stay in --out)."""
    from miles_control.reports import save_report

    console.print(text, markup=False, highlight=False)
    [report_id] = save_report(kind, out, text, job_ids, [url])
    from sqlalchemy.engine import make_url

    shown = make_url(url).render_as_string(hide_password=True)  # a PostgreSQL password is not printed
    # one line however narrow the terminal (or none, in a log): paths are copied from it
    console.print(
        f"report: {out / 'report.md'}; stored as report {report_id} in {shown}", highlight=False, soft_wrap=True
    )


def print_summary(store, job_id: int) -> None:
    from miles_control.summary import summarize

    s = summarize(store, job_id)
    out = Console()
    table = Table(title=f"job {job_id} ({s.status}): {s.num_steps} steps in {s.wall_s:.1f} s")
    for col in ("stage", "spans", "time (s)", "share of wall", "tokens/s"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for st in s.stages:  # an idle stage (the trainer waiting for data) is shown but not counted as work
        tps = "-" if st.tokens_per_s is None else f"{st.tokens_per_s:,.0f}"
        name = f"[dim]{st.stage} (trainer idle)[/]" if st.idle else st.stage
        table.add_row(name, str(st.count), f"{st.total_s:.2f}", f"{st.share_of_wall:.1%}", tps)
    if s.wall_s > 0 and not s.overlapping:  # what no stage accounts for: driver, Ray calls, store writes
        other = max(0.0, s.wall_s - s.work_s)
        table.add_row("[dim]other[/]", "", f"{other:.2f}", f"{other / s.wall_s:.1%}", "")
    out.print(table)
    if s.overlapping:
        out.print("stages overlapped (asynchronous schedule): their shares add up to more than 100 %")
    if s.wall_s > 0:
        out.print(
            f"busy: rollout {s.rollout_busy_s:.1f} s, trainer {s.trainer_busy_s:.1f} s; "
            f"achieved / ideal overlap bound {s.ratio_to_ideal:.2f}"
        )
    if s.weight_sync_s:
        out.print(
            f"weight update latency: mean {s.weight_sync_mean_s * 1000:.1f} ms, "
            f"p50 {s.percentile_sync(0.5) * 1000:.1f} ms, max {max(s.weight_sync_s) * 1000:.1f} ms"
        )
    if s.eval_accuracy:
        curve = ", ".join(f"{step}:{acc:.2f}" for step, acc in s.eval_accuracy)
        out.print(f"held-out accuracy by step: {curve}")
    out.print(f"store: {store.url} (job {job_id})")


register_control_commands(app)


def main() -> None:
    from miles_control.store import StoreError
    from miles_control.store.migrate import StoreSchemaError

    try:
        app(prog_name="miles")
    except (StoreError, StoreSchemaError) as exc:  # any command that opens a store: one line, exit 2
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
