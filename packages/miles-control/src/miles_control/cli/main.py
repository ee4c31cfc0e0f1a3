"""`miles` command line. Specs are validated before torch or Ray are imported.

Here: `run`, `export`, `data`, `schedule`; `bench …` is in `cli_bench`, `serve`, `dashboard`, `jobs …` and
`tokens …` in `cli_control`."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from miles_control.cli.bench import register as register_bench_commands
from miles_control.cli.common import Overrides, console, load_spec_or_exit
from miles_control.cli.control import register as register_control_commands
from miles_control.spec.config import DEFAULT_STORE_URL

app = typer.Typer(
    help="Miles: RL post-training with separate rollout and training, measured stage by stage.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Miles command line."""


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="Job spec (YAML).")],
    set_: Overrides = [],  # noqa: B006
    quiet: Annotated[bool, typer.Option(help="No progress: only held-out accuracy lines.")] = False,
    log_every: Annotated[
        int, typer.Option(min=1, help="Without a terminal (a log file, CI, nohup): a plain line every N steps.")
    ] = 10,
) -> None:
    """Run a job to the end, with live progress and a per-stage timing table.

    On a terminal, a progress bar; without one, a plain progress line every `--log-every` steps (and at each
    phase, evaluation and the last step), which a log file keeps readable."""
    spec = load_spec_or_exit(config, set_)

    from miles_control.job.redact import mask_credentials, mask_log_handlers
    from miles_control.job.run import run_job
    from miles_control.service.store import Store

    logging.basicConfig(level=logging.WARNING)
    mask_log_handlers()  # a warning (a tracker that cannot start) may quote a URL with its password
    store = Store(spec.store.url)
    # The run is handed `store`; the spec it records (the job's row, which the API shows; the trackers' config)
    # names the store without its password.
    spec = spec.model_copy(update={"store": spec.store.model_copy(update={"url": mask_credentials(spec.store.url)})})
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
        from miles_control.job.preflight import describe_error

        console.print(f"[bold red]job failed:[/] {escape(mask_credentials(describe_error(exc)))}", highlight=False)
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
    merged: Annotated[
        bool,
        typer.Option(help="A LoRA job's checkpoint: write the merged model instead of the adapter (PEFT's folder)."),
    ] = False,
) -> None:
    """Write a trained policy as a Hugging Face model folder (config, safetensors, tokenizer with its chat template,
    generation config), from a checkpoint of any backend; it loads with `from_pretrained` and serves with SGLang.
    A LoRA job's checkpoint gives its adapter as PEFT's folder (adapter_config.json naming the base model,
    adapter_model.safetensors), or with --merged the merged model."""
    from miles_control.service.export import (
        ExportError,
        export_adapter,
        export_checkpoint,
        find_checkpoint,
        has_adapter,
    )

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
        if has_adapter(checkpoint) and not merged:
            written = export_adapter(checkpoint, out, model, dtype)
        elif merged and not has_adapter(checkpoint):
            raise ExportError(f"--merged: {checkpoint} holds no LoRA adapter; its weights are the whole model already")
        else:
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

    from miles_control.service.schedule_changes import ScheduleChangeError, queue_schedule_change
    from miles_control.service.store import Store
    from miles_control.spec.yaml_safe import load_yaml

    patch, problems = {}, []
    for item in changes:
        key, sep, value = item.partition("=")
        if not sep:
            problems.append(f"{item!r}: expected field=value")
            continue
        try:
            patch[key] = load_yaml(value)
        except yaml.YAMLError as exc:
            problems.append(f"{item!r}: invalid YAML ({getattr(exc, 'problem', None) or exc})")
    if problems:
        for line in problems:
            console.print(f"[bold red]error:[/] {line}", highlight=False)
        raise typer.Exit(2)
    store = Store(store_url)
    try:  # the same check the API runs on PATCH /jobs/{id}/schedule
        change_id = queue_schedule_change(store, job_id, patch)
    except (KeyError, ScheduleChangeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) else str(exc)
        from miles_control.job.redact import mask_credentials

        console.print(f"[bold red]error:[/] {message} (store {mask_credentials(store_url)})", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"queued change {change_id} for job {job_id}: {patch} (applied at its next step)")


def print_summary(store, job_id: int) -> None:
    """Print a finished job's time per stage, busy time, weight-update latency and held-out accuracy."""
    from miles_control.service.summary import summarize

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
    from miles_control.job.redact import mask_credentials

    out.print(f"store: {mask_credentials(store.url)} (job {job_id})")


register_bench_commands(app)
register_control_commands(app)


def main() -> None:
    """The `miles` program: a store that cannot be opened is one line and exit 2, not a traceback."""
    from miles_control.service.store import StoreError
    from miles_control.service.store.migrate import StoreSchemaError

    try:
        app(prog_name="miles")
    except (StoreError, StoreSchemaError) as exc:  # any command that opens a store: one line, exit 2
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    sys.exit(main())
