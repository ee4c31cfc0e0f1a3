import sqlite3

import pytest

from miles_control.service.store import JobStatus, Store


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


# --- the job lifecycle, on SQLite and PostgreSQL -----------------------------------------------------
from miles_control.service.store import TRANSITIONS, InvalidTransition, JobNotFound  # noqa: E402
from miles_control.service.store.tokens import check_token, create_token, list_tokens, revoke_token  # noqa: E402


def job_in(store: Store, status: JobStatus) -> int:
    """A job brought to `status` along allowed transitions."""
    path = {
        JobStatus.QUEUED: [],
        JobStatus.STARTING: [JobStatus.STARTING],
        JobStatus.RUNNING: [JobStatus.STARTING, JobStatus.RUNNING],
        JobStatus.SUCCEEDED: [JobStatus.STARTING, JobStatus.RUNNING, JobStatus.SUCCEEDED],
        JobStatus.FAILED: [JobStatus.STARTING, JobStatus.FAILED],
        JobStatus.CANCELLED: [JobStatus.CANCELLED],
    }[status]
    job = store.create_job("j", {})
    for step in path:
        store.set_status(job, step)
    return job


def test_every_transition_is_allowed_or_refused_by_the_table(store_url):
    store = Store(store_url)
    for current in JobStatus:
        for wanted in JobStatus:
            job = job_in(store, current)
            if wanted in TRANSITIONS[current]:
                store.set_status(job, wanted)
                assert store.job(job).status == wanted.value
            else:
                with pytest.raises(InvalidTransition, match=f"is {current.value}; it cannot become {wanted.value}"):
                    store.set_status(job, wanted)
                assert store.job(job).status == current.value  # nothing changed
    store.engine.dispose()


def test_compare_and_set_refuses_a_stale_expectation(store_url):
    store = Store(store_url)
    job = job_in(store, JobStatus.QUEUED)
    store.request_cancel(job)
    with pytest.raises(InvalidTransition):  # the launcher saw it queued, but it was cancelled meanwhile
        store.set_status(job, JobStatus.STARTING, expect=JobStatus.QUEUED)
    store.engine.dispose()


def test_a_status_change_is_atomic_against_a_stale_read(store_url, monkeypatch):
    """Between a process's read and its write, another process cancels: the write must not happen."""
    store = Store(store_url)
    job = job_in(store, JobStatus.QUEUED)
    stale = store.job(job)
    store.request_cancel(job)  # another process, after our read
    reads = iter([stale])
    real_job = store.job
    monkeypatch.setattr(store, "job", lambda job_id: next(reads, None) or real_job(job_id))
    with pytest.raises(InvalidTransition, match="is cancelled; it cannot become starting"):
        store.set_status(job, JobStatus.STARTING)
    assert real_job(job).status == "cancelled"
    store.engine.dispose()


def test_cancel_resume_attempts_and_rollback_to_a_checkpoint(store_url):
    store = Store(store_url)
    queued = job_in(store, JobStatus.QUEUED)
    assert store.request_cancel(queued) == "cancelled"
    assert store.job(queued).error == "cancelled while queued"
    with pytest.raises(InvalidTransition, match="is cancelled"):
        store.request_cancel(queued)

    job = job_in(store, JobStatus.RUNNING)
    first = store.start_attempt(job, "local", driver_pid=123)
    assert (first.number, first.resume_step) == (1, 0)
    assert store.request_cancel(job) == "running" and store.job(job).cancel_requested
    for step in (1, 2, 3):
        store.add_step(job, step, step, 0.0, 1.0)
        store.add_metrics(job, step, {"loss": float(step)})
    store.add_checkpoint(job, 2, 2, "/ckpt/2")
    store.set_status(job, JobStatus.CANCELLED, error="cancelled")
    store.end_attempt(first.id, "cancelled")
    with pytest.raises(InvalidTransition, match="is succeeded"):
        store.resume(job_in(store, JobStatus.SUCCEEDED))
    assert store.resume(job) == 2
    row = store.job(job)
    assert (row.status, row.error, row.cancel_requested, row.finished_at) == ("queued", None, False, None)
    second = store.start_attempt(job, "local")
    assert (second.number, second.resume_step) == (2, 2)
    assert store.discard_from(job, 3) == 2  # step 3's step row and metric
    assert [s.step for s in store.steps(job)] == [1, 2] and store.metric_series(job, "loss") == [(1, 1.0), (2, 2.0)]
    assert [a.number for a in store.attempts(job, live_only=True)] == [2]
    with pytest.raises(JobNotFound, match="no job 999"):
        store.request_cancel(999)
    store.engine.dispose()


def test_tokens_are_stored_hashed_and_can_be_revoked(store_url):
    store = Store(store_url)
    row, token = create_token(store, "ci", "read")
    assert token.startswith("miles_") and len(token) > 40
    with store.engine.connect() as conn:  # the secret itself is nowhere in the database
        dump = " ".join(str(v) for r in conn.exec_driver_sql("SELECT * FROM api_tokens") for v in r)
    assert token not in dump and row.token_hash in dump
    assert check_token(store, token).scope == "read"
    assert check_token(store, token + "x") is None
    with pytest.raises(ValueError, match="scope must be one of read, admin"):
        create_token(store, "x", "root")
    revoke_token(store, row.id)
    assert check_token(store, token) is None
    assert list_tokens(store) == [] and [t.name for t in list_tokens(store, include_revoked=True)] == ["ci"]
    store.engine.dispose()
