"""`sweep(spec, variants)`: the same workload under a few variants of its spec, side by side.

Each variant is a few dotted-path fields of the spec changed. It runs as its own job (same spec, same seed, the
same number of steps) into one store, and is summarized from what that job recorded (`miles_control.service.summary`).
The compare-benches are sweeps: `schedules.py` over the schedule types, `algorithms.py` over the objectives,
`precision.py` over the precision recipes; each adds its own measures and report.

Every job a sweep runs carries an event of kind `sweep_variant` naming its variant, so that a store read later
says which job ran which variant (`recorded_variants`): the results are read back from the store, not from a
report's layout."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_control.service.reports import bench_url
from miles_control.service.store import Store
from miles_control.service.summary import RunSummary, summarize
from miles_control.spec.config import JobSpec

VARIANT_EVENT = "sweep_variant"
Overrides = Mapping[str, Any]  # dotted path → value, e.g. {"train.algorithm.name": "rloo"}


@dataclass
class VariantRun:
    """One variant of a sweep: the spec it ran, its job and that job's summary; or why it was refused."""

    name: str
    overrides: Overrides
    spec: JobSpec | None = None
    job_id: int | None = None
    summary: RunSummary | None = None
    refused: str | None = None


def with_overrides(base: JobSpec, overrides: Overrides) -> JobSpec:
    """`base` with dotted-path fields replaced; a path without a dot replaces a whole section."""
    data = base.model_dump(mode="json")
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[leaf] = copy.deepcopy(value)  # the caller's variants stay as given
    return JobSpec.model_validate(data)


def sweep(
    spec: JobSpec,
    variants: Mapping[str, Overrides],
    out: Path,
    store_url: str | None = None,
    *,
    job_name: Callable[[int, str], str] | None = None,
    check: Callable[[JobSpec], None] | None = None,
    on_run: Callable[[Store, VariantRun], None] = lambda store, run: None,
) -> list[VariantRun]:
    """Run `spec` once per variant, in order, into `store_url` (default `out/bench.db`); a run per variant.

    Every job runs its spec's number of steps (`schedule.stop_at_accuracy` off). A job is named
    `job_name(index, variant)` (default `<spec name>-bench-<variant>`). With `check`, a variant whose spec does not
    validate or that `check` refuses (ValueError) is kept as refused, with the first line of the reason, and the
    sweep goes on; without it, that error stops the sweep, as does a job that recorded no steps. `on_run` gets each
    run as it ends (refused ones too), with the store it was recorded in."""
    from miles_control.job.run import run_job

    out.mkdir(parents=True, exist_ok=True)
    url = store_url or bench_url(out)
    store = Store(url)
    runs = []
    for index, (name, overrides) in enumerate(variants.items()):
        run = VariantRun(name, overrides)
        shared = {
            "name": job_name(index, name) if job_name else f"{spec.name}-bench-{name.replace(':', '-')}",
            "schedule.stop_at_accuracy": None,  # the same number of steps for every variant
            "store.url": url,
        }
        try:
            run.spec = with_overrides(spec, {**overrides, **shared})
            if check is not None:
                check(run.spec)
        except ValueError as exc:
            if check is None:  # without checks, a variant that does not validate is the caller's mistake
                raise
            run.refused = str(exc).splitlines()[0]
        else:
            run.job_id = run_job(run.spec, store=store)
            data = {"variant": name, "overrides": dict(overrides)}
            store.add_event(run.job_id, VARIANT_EVENT, f"variant {name!r} of a sweep", data=data)
            run.summary = summarize(store, run.job_id)
            if not run.summary.num_steps:
                raise RuntimeError(f"job {run.job_id} ({name}) recorded no steps: {store.job(run.job_id).error}")
        runs.append(run)
        on_run(store, run)
    return runs


def recorded_variants(store: Store) -> dict[str, int]:
    """Variant → id of the job that ran it, for every job a sweep ran into `store` (the latest, where a variant
    ran more than once)."""
    jobs, _ = store.jobs(limit=sum(store.count_by_status().values()))
    found = {}
    for job in reversed(jobs):  # oldest first: a later run of a variant replaces an earlier one
        for e in store.events(job.id):
            if e.kind == VARIANT_EVENT:
                found[e.data["variant"]] = job.id
    return found


def plot_by_variant(
    path: Path,
    curves: Mapping[str, Sequence[tuple[float, float]]],
    xlabel: str,
    ylabel: str,
    figsize: tuple[float, float] = (7, 4),
    legend_fontsize: float | None = None,
) -> str:
    """Plot a line per variant (its (x, y) points, labelled with its name) into the PNG `path`; its file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize, dpi=110)
    for name, points in curves.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker=".", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name
