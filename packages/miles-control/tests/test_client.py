"""The typed API client (miles_control.client) against a real `miles serve`: it covers every operation of the
OpenAPI document the server publishes, with the document's verbs and paths, and returns the API's models."""

import inspect

import httpx
import pytest

from miles_control.client import OPERATIONS, ApiError, MilesClient
from miles_control.service.api.schemas import JobDetail, RunSummaryPublic, SpanPublic
from miles_control.service.store import JobStatus


def token_of(headers: dict) -> str:
    return headers["Authorization"].removeprefix("Bearer ")


def test_every_operation_has_a_method_with_the_documents_verb_and_path(api):
    document = httpx.get(api.url + "/openapi.json").json()
    published = {
        op["operationId"]: (verb.upper(), path) for path, ops in document["paths"].items() for verb, op in ops.items()
    }
    assert {k: (m, p) for k, (m, p, _) in OPERATIONS.items()} == published
    for _, _, method in OPERATIONS.values():
        assert inspect.isfunction(getattr(MilesClient, method, None)), method


def test_calls_return_the_apis_models_and_errors_name_the_field(api):
    admin = MilesClient(api.url, token_of(api.admin))
    reader = MilesClient(api.url, token_of(api.read))
    assert admin.health().status == "ok"
    assert reader.presets() == []  # this server's presets_dir (examples/ where it runs) does not exist
    created = admin.create_job({"name": "typed", "schedule": {"type": "fully_async", "num_steps": 3}})
    assert isinstance(created, JobDetail) and created.status == "queued" and created.num_steps == 3
    job_id = created.id
    api.store.set_status(job_id, JobStatus.STARTING)
    api.store.set_status(job_id, JobStatus.RUNNING)
    for step in (1, 2):
        api.store.add_spans(job_id, [dict(stage="train", step=step, worker="trainer", start=step, end=step + 0.5)])
        api.store.add_step(job_id, step, step, float(step), step + 1.0)
        api.store.add_metrics(job_id, step, {"train/loss": 1.0 / step})
    assert [p.value for p in reader.metrics(job_id, ["train/loss"], step_min=2)] == [0.5]
    assert reader.metric_names(job_id) == ["train/loss"]
    spans = reader.spans(job_id, stage="train")
    assert all(isinstance(s, SpanPublic) for s in spans) and [s.step for s in spans] == [1, 2]
    summary = reader.summary(job_id)
    assert isinstance(summary, RunSummaryPublic) and summary.num_steps == 2 and summary.wall_s == 2.0
    assert [s.step for s in reader.steps(job_id)] == [1, 2]
    assert reader.jobs(status=["running"]).total == 1
    assert admin.choices("SchedulePatch", "pause_mode") == ["in_place", "retract", "abort"]
    change = admin.patch_schedule(job_id, {"max_staleness": 2})
    assert change.status == "pending" and [c.id for c in reader.schedule_changes(job_id)] == [change.id]
    with pytest.raises(ApiError) as refused:  # the read token cannot change anything
        reader.cancel(job_id)
    assert refused.value.status == 403
    with pytest.raises(ApiError) as bad:
        admin.create_job({"name": "bad", "rollout": {"sampling": {"top_p": 5}}})
    assert bad.value.status == 422 and "rollout.sampling.top_p" in bad.value.fields
    jobs_before = reader.jobs().total
    checked = admin.validate_job({"name": "checked", "schedule": {"type": "one_step_off"}})
    assert checked["schedule"]["update_weights_interval"] == 1 and checked["output_dir"].startswith("/")  # filled in
    with pytest.raises(ApiError) as bad:
        admin.validate_job({"name": "bad", "schedule": {"max_stalenes": 2}})
    assert bad.value.fields == {"schedule.max_stalenes": "Extra inputs are not permitted; did you mean "
                                "'max_staleness' (a field of fully_async, not of sync)?"}  # fmt: skip
    with pytest.raises(ApiError) as bad:  # the same checks as create_job, the server's policy included
        admin.validate_job({"name": "bad", "ray": {"address": "10.0.0.1:6379"}})
    assert bad.value.status == 422 and list(bad.value.fields) == ["ray.address"]
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(40))
    report_id = api.store.add_report("schedules", "Schedule bench", "# Schedule bench\n\n![r](reward.png)\n", [job_id],
                                     {"reward.png": png})  # fmt: skip
    [listed] = reader.reports("schedules")
    assert listed.id == report_id and listed.job_ids == [job_id] and reader.reports("precision") == []
    detail = reader.report(report_id)
    assert detail.files == ["reward.png"] and "![r](reward.png)" in detail.markdown
    assert reader.report_file(report_id, "reward.png") == png  # the bytes, as stored
    with pytest.raises(ApiError) as missing:
        reader.report_file(report_id, "other.png")
    assert missing.value.status == 404
    with pytest.raises(ApiError) as refused:
        reader.validate_job({"name": "x"})
    assert refused.value.status == 403 and reader.jobs().total == jobs_before  # validating creates nothing
    assert admin.cancel(job_id).cancel_requested
    api.store.set_status(job_id, JobStatus.CANCELLED)
    kinds = [kind for kind, _, _ in reader.stream_events(job_id)]
    assert kinds[-1] == "end" and "cancel" in kinds
    with pytest.raises(ApiError, match="404: no job 999"):
        reader.job(999)
    with pytest.raises(ApiError, match="cannot reach the Miles API"):
        MilesClient("http://127.0.0.1:9", "x").health()
