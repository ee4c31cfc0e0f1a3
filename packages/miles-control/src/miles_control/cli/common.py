"""What the modules of the `miles` command line share: the console on stderr, the `--set` option and loading a
job spec (validated before torch or Ray are imported)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from miles_control.spec.load import SpecError, load_spec

console = Console(stderr=True)

Overrides = Annotated[list[str], typer.Option("--set", help="Override a field: path.to.field=value (repeatable).")]


def load_spec_or_exit(config: Path, overrides: list[str]):
    """The validated spec, or exit 2 with one line per problem (naming the field) before anything loads."""
    try:
        return load_spec(config, overrides)
    except SpecError as exc:
        console.print(f"[bold red]error:[/] invalid job spec [bold]{exc.source}[/]")
        for line in exc.errors:
            console.print(f"  {line}", markup=False, highlight=False)
        raise typer.Exit(2) from None
