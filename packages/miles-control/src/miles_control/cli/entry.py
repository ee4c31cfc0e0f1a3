"""The `miles` console script: the CLI, or one clear line when only the API client is installed.

`pip install miles-control` alone is the torch-free API client; the commands (`miles run`, `serve`, `jobs`, ...)
need the control plane, `pip install "miles-control[full]"`. Without it the import of the CLI fails on a missing
module, and this says so instead of a traceback.
"""

from __future__ import annotations

import sys

FULL = {"miles_sync", "miles_rollout", "miles_train", "typer", "rich", "yaml", "sqlalchemy", "fastapi", "ray"}


def main() -> None:
    try:
        from miles_control.cli.main import main as cli_main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in FULL:
            raise
        sys.stderr.write(
            f"error: the `miles` commands need the whole control plane ({exc.name} is not installed); "
            'install it with: pip install "miles-control[full]"\n'
        )
        sys.exit(2)
    cli_main()
