"""`sweep(spec, variants)`, the loop under the compare-benches, with the job itself faked: a job that records the
given number of steps into the real store (the benches run whole jobs in tests/test_bench.py and
tests/test_algorithms.py)."""

import pytest
from pydantic import ValidationError

from miles_control.bench.sweep import recorded_variants, sweep, with_overrides
from miles_control.service.store import JobStatus, Store
from miles_control.spec.config import JobSpec


@pytest.fixture
def ran(monkeypatch) -> list[JobSpec]:
    """The specs the faked `run_job` ran, in order; each job records `schedule.num_steps` steps."""
    specs: list[JobSpec] = []

    def run_job(spec: JobSpec, store: Store) -> int:
        specs.append(spec)
        job_id = store.create_job(spec.name, spec.model_dump(mode="json"), status=JobStatus.STARTING)
        store.set_status(job_id, JobStatus.RUNNING)
        for step in range(1, spec.schedule.num_steps + 1):
            store.add_step(job_id, step, step, 10.0 * step, 10.0 * step + 5)
        store.set_status(job_id, JobStatus.SUCCEEDED)
        return job_id

    monkeypatch.setattr("miles_control.job.run.run_job", run_job)
    return specs


BASE = JobSpec.model_validate({"name": "demo", "schedule": {"type": "sync", "num_steps": 2, "stop_at_accuracy": 0.9}})


def test_each_variant_runs_as_its_own_job_and_is_found_again_in_the_store(tmp_path, ran):
    variants = {"bf16": {"train.precision": "bf16"}, "rloo": {"train.algorithm.name": "rloo"}}
    seen = []
    runs = sweep(BASE, variants, tmp_path / "out", on_run=lambda store, run: seen.append(run.name))
    assert [r.name for r in runs] == seen == ["bf16", "rloo"]  # in order, each reported as it ends
    assert all(r.refused is None and r.summary is not None and r.summary.num_steps == 2 for r in runs)
    assert [s.name for s in ran] == ["demo-bench-bf16", "demo-bench-rloo"]
    assert (ran[0].train.precision, ran[1].train.algorithm.name) == ("bf16", "rloo")
    assert ran[1].train.precision == BASE.train.precision  # a variant changes only its own fields
    url = f"sqlite:///{(tmp_path / 'out').resolve()}/bench.db"
    assert {s.store.url for s in ran} == {url} and {s.schedule.stop_at_accuracy for s in ran} == {None}
    assert recorded_variants(Store(url)) == {r.name: r.job_id for r in runs}
    assert variants == {"bf16": {"train.precision": "bf16"}, "rloo": {"train.algorithm.name": "rloo"}}


def test_with_a_check_a_refused_variant_is_kept_with_its_reason_and_the_sweep_goes_on(tmp_path, ran):
    def check(spec: JobSpec) -> None:
        if spec.train.precision == "fp16":
            raise ValueError("train.precision: fp16 is not for this model\nmore detail")

    variants = {"fp16": {"train.precision": "fp16"}, "typo": {"train.precision": "fp7"}, "fp32": {}}
    runs = sweep(BASE, variants, tmp_path, check=check, job_name=lambda index, name: f"demo-{index}")
    assert [(r.name, r.refused is None) for r in runs] == [("fp16", False), ("typo", False), ("fp32", True)]
    assert runs[0].refused == "train.precision: fp16 is not for this model"  # its first line
    # a spec that does not validate is refused the same way (the first line of pydantic's message says only that)
    assert runs[1].refused == "1 validation error for JobSpec"
    assert [s.name for s in ran] == ["demo-2"]  # named by its place among the variants
    assert recorded_variants(Store(f"sqlite:///{tmp_path.resolve()}/bench.db")) == {"fp32": runs[2].job_id}


def test_without_a_check_an_invalid_variant_or_a_job_without_steps_stops_the_sweep(tmp_path, ran, monkeypatch):
    with pytest.raises(ValidationError, match="fp7"):
        sweep(BASE, {"typo": {"train.precision": "fp7"}}, tmp_path)
    assert ran == []

    def run_nothing(spec: JobSpec, store: Store) -> int:
        job_id = store.create_job(spec.name, {}, status=JobStatus.STARTING)
        store.set_status(job_id, JobStatus.FAILED, error="engine died")
        return job_id

    monkeypatch.setattr("miles_control.job.run.run_job", run_nothing)
    with pytest.raises(RuntimeError, match=r"job \d+ \(fp32\) recorded no steps: engine died"):
        sweep(BASE, {"fp32": {}, "bf16": {"train.precision": "bf16"}}, tmp_path)


def test_with_overrides_sets_dotted_fields_and_replaces_whole_sections():
    spec = with_overrides(BASE, {"schedule": {"type": "one_step_off", "num_steps": 3}, "ray.cpu_split": True})
    assert (spec.schedule.type, spec.schedule.num_steps, spec.ray.cpu_split) == ("one_step_off", 3, True)
    assert spec.schedule.stop_at_accuracy is None  # the whole section replaced: its other fields are defaults


def test_plot_by_variant_writes_a_png_with_a_line_per_variant(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    from miles_control.bench.sweep import plot_by_variant

    curves = {"sync": [(0.0, 0.4), (10.0, 0.5)], "fully_async": [(0.0, 0.4), (6.0, 0.5)], "refused": []}
    assert plot_by_variant(tmp_path / "reward.png", curves, "s", "reward") == "reward.png"
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
