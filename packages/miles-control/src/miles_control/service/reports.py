"""Bench reports kept in the store with their runs, so that the API (and the dashboard's Reports page) finds them
wherever the bench ran: `miles bench ...` stores its report in the bench's own `bench.db` and, with `--store URL`,
in that store too (e.g. the one `miles serve` reads)."""

from __future__ import annotations

from pathlib import Path

from miles_control.service.store import Store

KINDS = ("schedules", "precision", "algorithms", "weights")


def bench_url(out: Path) -> str:
    """The store a bench records its runs and report in by default: `out/bench.db`."""
    return f"sqlite:///{out.resolve()}/bench.db"


def title_of(markdown: str, kind: str) -> str:
    """The report's first heading, else "<kind> bench"."""
    for line in markdown.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return f"{kind} bench"


def save_report(kind: str, out: Path, markdown: str, job_ids: list[int], stores: list[str]) -> list[int]:
    """Store the report (its markdown, the PNG files of `out` it links, the jobs it ran) in each store URL;
    returns the ids it got in each."""
    linked = {p.name: p.read_bytes() for p in sorted(out.glob("*.png")) if f"({p.name})" in markdown}
    return [Store(url).add_report(kind, title_of(markdown, kind), markdown, job_ids, linked) for url in stores]
