"""`miles serve`, `miles jobs …` (a client of the REST API) and `miles tokens …` (on the store)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from miles_control.spec.config import DEFAULT_STORE_URL

console = Console(stderr=True)
out = Console()

DEFAULT_API = "http://127.0.0.1:8420"
ApiUrl = Annotated[str, typer.Option("--api", envvar="MILES_API_URL", help="Base URL of `miles serve`.")]
Token = Annotated[str, typer.Option("--token", envvar="MILES_TOKEN", help="Bearer token (`miles tokens create`).")]
StoreUrl = Annotated[str, typer.Option("--store", envvar="MILES_STORE_URL", help="SQLAlchemy URL of the job store.")]


def _fail(message: str, code: int = 1) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8420,
    store: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the job store [MILES_STORE_URL].")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Server state: logs, runs, local Ray [MILES_DATA_DIR].")] = None,
    data_root: Annotated[Path | None, typer.Option(help="Prompt files must lie under it [MILES_DATA_ROOT].")] = None,
    model_root: Annotated[Path | None, typer.Option(help="Model folders must lie under it [MILES_MODEL_ROOT].")] = None,
    launcher: Annotated[str | None, typer.Option(help="local | ray_job | off [MILES_LAUNCHER].")] = None,
    ray_address: Annotated[str | None, typer.Option(help="Ray instance or dashboard URL [MILES_RAY_ADDRESS].")] = None,
    cpus: Annotated[float | None, typer.Option(help="CPUs jobs may use at once [MILES_CPUS].")] = None,
    gpus: Annotated[
        float | None, typer.Option(help="GPUs jobs may use; default: this machine's or the cluster's [MILES_GPUS].")
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Run the REST API (and the launcher that starts queued jobs). Docs at /docs, spec at /openapi.json."""
    import logging

    import uvicorn
    from pydantic import ValidationError

    from miles_control.service.api.app import create_app
    from miles_control.service.settings import ServerSettings

    given = dict(
        store_url=store, data_dir=data_dir, data_root=data_root, model_root=model_root,
        launcher=launcher, ray_address=ray_address, cpus=cpus, gpus=gpus,
    )  # fmt: skip
    try:
        settings = ServerSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        for err in exc.errors():
            console.print(f"[bold red]error:[/] {'.'.join(map(str, err['loc']))}: {err['msg']}", highlight=False)
        raise typer.Exit(2) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    from miles_control.service.store.store import shown_url

    console.print(
        f"Miles API on http://{host}:{port} (store {shown_url(settings.store_url)}, launcher {settings.launcher})"
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            app.state.stopping.set()  # event streams end now instead of holding the shutdown open
            super().handle_exit(sig, frame)

    # A client that holds a connection open past the grace period is cut off.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
    Server(config).run()


def dashboard(
    api: ApiUrl = DEFAULT_API,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8501,
) -> None:
    """Run the Streamlit dashboard (jobs, live metrics and timelines, schedule tuning, comparisons).

    The dashboard is its own app (apps/dashboard, `miles-dashboard`); this runs it with the same flags. Each
    visitor signs in with their own token; the dashboard holds none (MILES_TOKEN is removed from its environment).
    Streamlit replaces this process, so a signal to it stops the dashboard."""
    import importlib.util
    import sys

    if importlib.util.find_spec("miles_dashboard") is None:
        _fail("the dashboard is not installed: pip install ./apps/dashboard (from a Miles checkout)", 2)
    cmd = [sys.executable, "-m", "miles_dashboard", "--api", api, "--host", host, "--port", str(port)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)  # miles-dashboard then becomes Streamlit: no child is left behind


def printable(text: str | None) -> str:
    """Text from the store or the API as a terminal may print it: control characters (escape sequences, bells,
    carriage returns) shown as visible escapes."""
    import unicodedata

    if text is None:
        return ""
    return "".join(ch if ch == "\n" or unicodedata.category(ch) not in ("Cc", "Cf") else ascii(ch)[1:-1] for ch in text)


def shown(text: str | None) -> str:
    """`printable(text)` with Rich markup escaped."""
    return escape(printable(text))


# --- jobs: a client of the API ------------------------------------------------------------------
jobs_app = typer.Typer(help="Jobs of a running `miles serve`, over its REST API.", no_args_is_help=True)


def _client(api: str, token: str):
    """The typed API client (miles_control.client); a missing token fails before any request."""
    from miles_control.client import MilesClient

    if not token:
        _fail("no token: pass --token or set MILES_TOKEN (create one with `miles tokens create`)", 2)
    return MilesClient(api, token)


def _api_call(call):
    """Run `call()`; an API error ends the command with the server's message."""
    from miles_control.client import ApiError

    try:
        return call()
    except ApiError as exc:
        hint = "; is `miles serve` running?" if exc.status is None else ""
        _fail(exc.message + hint)


@jobs_app.command("list")
def jobs_list(
    api: ApiUrl = DEFAULT_API,
    token: Token = "",
    status: Annotated[list[str], typer.Option(help="Only these statuses (repeatable).")] = [],  # noqa: B006
    limit: Annotated[int, typer.Option(min=1, max=500)] = 20,
) -> None:
    """Newest jobs first."""
    client = _client(api, token)
    page = _api_call(lambda: client.jobs(status=status, limit=limit))
    table = Table(title=f"{len(page.items)} of {page.total} jobs")
    for col in ("id", "name", "status", "schedule", "step", "created"):
        table.add_column(col)
    for job in page.items:
        step = f"{job.last_step or 0}/{job.num_steps}"
        created = job.created_at.isoformat(sep=" ")[:19]
        table.add_row(str(job.id), shown(job.name), job.status, job.schedule, step, created)
    out.print(table)


@jobs_app.command("show")
def jobs_show(job_id: int, api: ApiUrl = DEFAULT_API, token: Token = "") -> None:
    """Status, attempts, checkpoints and the newest metrics of a job."""
    client = _client(api, token)
    job = _api_call(lambda: client.job(job_id))
    out.print(f"[bold]job {job.id}[/] {shown(job.name)}: [bold]{job.status}[/] ({job.schedule}, "
              f"step {job.last_step or 0}/{job.num_steps})")  # fmt: skip
    if job.error:
        out.print(f"error: {shown(job.error)}", highlight=False)
    for a in job.attempts:
        where = f"pid {a.driver_pid} on {shown(a.driver_host)}" if a.driver_pid else shown(a.submission_id)
        out.print(f"attempt {a.number} ({a.launcher}, from step {a.resume_step}): {a.status} {where} "
                  f"{shown(a.exit_reason)}", highlight=False)  # fmt: skip
    if job.checkpoints:
        out.print(f"checkpoints at steps {', '.join(str(c.step) for c in job.checkpoints)}")
    latest: dict[str, tuple[int, float]] = {}
    for point in _api_call(lambda: client.metrics(job_id)):
        latest[point.name] = (point.step, point.value)
    if latest:
        table = Table(title="newest value of each metric")
        for col in ("metric", "step", "value"):
            table.add_column(col)
        for name, (step, value) in sorted(latest.items()):
            table.add_row(shown(name), str(step), f"{value:.4g}")
        out.print(table)


@jobs_app.command("cancel")
def jobs_cancel(job_id: int, api: ApiUrl = DEFAULT_API, token: Token = "") -> None:
    """Cancel a queued job at once, or stop a running one (its driver gets SIGTERM)."""
    client = _client(api, token)
    job = _api_call(lambda: client.cancel(job_id))
    out.print(f"job {job_id}: {job.status}" + (" (cancel requested)" if job.status != "cancelled" else ""))


@jobs_app.command("resume")
def jobs_resume(job_id: int, api: ApiUrl = DEFAULT_API, token: Token = "") -> None:
    """Queue a failed or cancelled job again; it starts after its last checkpoint."""
    client = _client(api, token)
    job = _api_call(lambda: client.resume(job_id))
    last = job.checkpoints[-1].step if job.checkpoints else 0
    out.print(f"job {job_id}: {job.status} (resumes after step {last})")


@jobs_app.command("logs")
def jobs_logs(
    job_id: int,
    api: ApiUrl = DEFAULT_API,
    token: Token = "",
    attempt: Annotated[int | None, typer.Option(help="Attempt number (default: the last).")] = None,
    tail: Annotated[int, typer.Option(help="Bytes from the end.")] = 64 << 10,
    source: Annotated[
        str, typer.Option(help="driver, or engine-<i> for SGLang server i's log (--list shows what there is).")
    ] = "driver",
    list_sources: Annotated[bool, typer.Option("--list", help="List the attempt's logs and their sizes.")] = False,
) -> None:
    """The driver log of an attempt, or one of its SGLang servers' logs."""
    client = _client(api, token)
    if list_sources:
        for item in _api_call(lambda: client.log_sources(job_id, attempt)):
            out.print(f"{item.name:<10} {item.size_bytes:>10} bytes  {item.description}", markup=False)
        return
    text = _api_call(lambda: client.logs(job_id, attempt, tail, source))
    out.print(text, markup=False, highlight=False, end="")


@jobs_app.command("events")
def jobs_events(
    job_id: int,
    api: ApiUrl = DEFAULT_API,
    token: Token = "",
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream new events until the job ends.")] = False,
) -> None:
    """A job's events (status changes, launches, schedule changes, checkpoints, errors)."""
    client = _client(api, token)

    def show(created: str, kind: str, step: int | None, message: str) -> None:
        where = f" step {step}" if step is not None else ""
        out.print(f"{created[:19]} [{kind}]{where} {printable(message)}", markup=False, highlight=False)

    if not follow:
        for event in _api_call(lambda: client.events(job_id, limit=1000)):
            show(event.created_at.isoformat(sep=" "), event.kind, event.step, event.message)
        return
    _api_call(lambda: client.job(job_id))  # a clear error for an unknown job or a bad token

    def follow_stream() -> None:
        for kind, data, _ in client.stream_events(job_id):
            if kind == "end":
                out.print(f"job {job_id} is {data['status']}")
            else:
                show(str(data["created_at"]).replace("T", " "), data["kind"], data.get("step"), data["message"])

    _api_call(follow_stream)


# --- tokens: directly on the store (who runs this can read the database anyway) -----------------
tokens_app = typer.Typer(help="Bearer tokens of the REST API, stored hashed.", no_args_is_help=True)
DEFAULT_STORE = os.environ.get("MILES_STORE_URL", DEFAULT_STORE_URL)


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Option(help="Who or what uses the token.")],
    scope: Annotated[str, typer.Option(help="read (GET only) or admin (also creates, cancels, patches).")] = "read",
    store: StoreUrl = DEFAULT_STORE,
) -> None:
    """Create a token and print it once (only its hash is stored)."""
    from miles_control.service.store import Store
    from miles_control.service.store.tokens import create_token

    try:
        row, token = create_token(Store(store), name, scope)  # type: ignore[arg-type]
    except ValueError as exc:
        _fail(str(exc), 2)
    console.print(f"token {row.id} ({row.name}, {row.scope}); shown once, keep it:")
    print(token)


@tokens_app.command("list")
def tokens_list(
    store: StoreUrl = DEFAULT_STORE, all_: Annotated[bool, typer.Option("--all", help="Include revoked.")] = False
) -> None:
    from miles_control.service.store import Store
    from miles_control.service.store.tokens import list_tokens

    table = Table()
    for col in ("id", "name", "scope", "prefix", "created", "last used", "revoked"):
        table.add_column(col)
    for t in list_tokens(Store(store), include_revoked=all_):
        when = [str(x)[:19] if x else "-" for x in (t.created_at, t.last_used_at, t.revoked_at)]
        table.add_row(str(t.id), shown(t.name), t.scope, t.prefix + "…", *when)
    out.print(table)


@tokens_app.command("revoke")
def tokens_revoke(token_id: int, store: StoreUrl = DEFAULT_STORE) -> None:
    """Revoke a token; requests with it get 401 from then on."""
    from miles_control.service.store import Store
    from miles_control.service.store.tokens import revoke_token

    try:
        revoke_token(Store(store), token_id)
    except KeyError as exc:
        _fail(str(exc.args[0]), 2)
    console.print(f"token {token_id} revoked")


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(dashboard)
    app.add_typer(jobs_app, name="jobs")
    app.add_typer(tokens_app, name="tokens")
