"""`miles-dashboard`: serve the dashboard with Streamlit (also what `miles dashboard` runs)."""

from __future__ import annotations

import argparse
import os
import sys

from miles_dashboard import APP

DEFAULT_API = "http://127.0.0.1:8420"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-dashboard",
        description="Run the Miles dashboard (jobs, live metrics and timelines, schedule tuning, comparisons, "
        "reports) over the REST API of `miles serve`. Each visitor signs in with their own token.",
    )
    parser.add_argument(
        "--api",
        default=os.environ.get("MILES_API_URL", DEFAULT_API),
        help="The Miles API's base URL [MILES_API_URL; default %(default)s].",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Interface to listen on [%(default)s].")
    parser.add_argument("--port", type=int, default=8501, help="TCP port [%(default)s].")
    return parser


def streamlit_command(host: str, port: int) -> list[str]:
    """The command line that serves the app: Streamlit in this interpreter, headless, no usage statistics, and
    Streamlit's developer toolbar hidden."""
    return [
        sys.executable, "-m", "streamlit", "run", str(APP), "--server.address", host, "--server.port", str(port),
        "--server.headless", "true", "--browser.gatherUsageStats", "false",
        "--client.toolbarMode", "viewer",  # no Deploy button or developer menu for the people who use it
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and become the Streamlit server (exec: no child is left behind, and SIGTERM reaches
    Streamlit itself). The dashboard process holds no token: MILES_TOKEN is removed from its environment."""
    args = build_parser().parse_args(argv)
    if not 0 < args.port < 65536:
        build_parser().error(f"--port: {args.port} is not a TCP port (1-65535)")
    print(f"Miles dashboard on http://{args.host}:{args.port} (API {args.api}; visitors sign in with their own token)")
    env = {k: v for k, v in os.environ.items() if k != "MILES_TOKEN"} | {"MILES_API_URL": args.api}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, streamlit_command(args.host, args.port), env)
