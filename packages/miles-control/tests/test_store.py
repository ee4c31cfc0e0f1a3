import sqlite3

import pytest

from miles_control.store import JobStatus, Store


@pytest.fixture
def store(tmp_path):
    return Store(f"sqlite:///{tmp_path}/m.db")


def test_job_lifecycle_and_records(store):
    job = store.create_job("demo", {"name": "demo"})
    assert store.job(job).status == "queued"
    store.set_status(job, JobStatus.STARTING)
    store.set_status(job, JobStatus.RUNNING)
    store.add_spans(job, [dict(stage="train", step=1, worker="t", start=1.0, end=3.5, num_tokens=10, attrs={"a": 1})])
    store.add_metrics(job, 1, {"train/loss": 0.5, "eval/accuracy": 0.25})
    store.add_metrics(job, 2, {"eval/accuracy": 0.5})
    store.add_step(job, 1, weight_version=1, started_at=1.0, ended_at=4.0)
    store.add_event(job, "model", "built", data={"path": "/x"})
    store.set_status(job, JobStatus.SUCCEEDED)
    assert store.metric_series(job, "eval/accuracy") == [(1, 0.25), (2, 0.5)]
    [span] = store.spans(job, "train")
    assert span.duration == 2.5 and span.attrs == {"a": 1}
    assert [s.weight_version for s in store.steps(job)] == [1]
    assert [e.data for e in store.events(job) if e.kind == "model"] == [{"path": "/x"}]
    assert [e.message for e in store.events(job) if e.kind == "status"] == [
        "queued → starting",
        "starting → running",
        "running → succeeded",
    ]
    assert store.job(job).finished_at is not None


def test_final_status_cannot_change_and_unknown_job(store):
    job = store.create_job("demo", {})
    store.set_status(job, JobStatus.FAILED, error="boom")
    with pytest.raises(ValueError, match="is failed; it cannot become running"):
        store.set_status(job, JobStatus.RUNNING)
    assert store.job(job).error == "boom"
    with pytest.raises(KeyError, match="no job 999"):
        store.job(999)


def test_sqlite_uses_wal_and_survives_reopen(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    job = Store(url).create_job("a", {})
    Store(url).add_metrics(job, 1, {"x": 1.0})
    assert Store(url).metric_series(job, "x") == [(1, 1.0)]
    assert sqlite3.connect(tmp_path / "m.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
