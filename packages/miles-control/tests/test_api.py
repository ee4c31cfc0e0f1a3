"""The REST API against a real `miles serve` process on loopback, on SQLite and PostgreSQL.

The launcher is off here (jobs stay queued); launching real jobs is tested in tests/test_control_plane.py."""

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from miles_control.service.store import JobStatus, Store
from miles_control.service.store.tokens import revoke_token
from miles_control.spec.config import JobSpec


def test_tokens_scopes_and_open_routes(api):
    assert httpx.get(api.url + "/api/v1/health").json()["status"] == "ok"
    assert httpx.get(api.url + "/docs").status_code == 200
    assert httpx.get(api.url + "/openapi.json").status_code == 200
    r = httpx.get(api.url + "/api/v1/jobs")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["detail"] == "missing bearer token"
    assert api.get("/api/v1/jobs", headers={"Authorization": "Bearer miles_nope"}).status_code == 401
    assert api.get("/api/v1/jobs").status_code == 200
    r = api.post("/api/v1/jobs", headers=api.read, json={"spec": {"name": "x"}})
    assert r.status_code == 403 and "read-only" in r.json()["detail"]
    assert httpx.get(api.url + "/metrics").status_code == 401
    api.create("a")
    metrics = api.get("/metrics").text
    assert 'miles_jobs{status="queued"} 1.0' in metrics and "miles_http_requests_total" in metrics
    revoke_token(api.store, api.read_token_id)
    r = api.get("/api/v1/jobs")
    assert r.status_code == 401 and r.json()["detail"] == "invalid or revoked token"


def test_create_list_get_and_pagination(api):
    created = [api.create(name) for name in ("alpha", "beta", "gamma")]
    assert created[0]["status"] == "queued" and created[0]["source"] == "api"
    assert created[0]["spec"]["output_dir"].endswith("/state/runs")  # the server's runs folder, absolute
    assert "store" not in created[0]["spec"]
    page = api.get("/api/v1/jobs", params={"limit": 2}).json()
    assert page["total"] == 3 and [j["name"] for j in page["items"]] == ["gamma", "beta"]
    page = api.get("/api/v1/jobs", params={"limit": 2, "offset": 2}).json()
    assert [j["name"] for j in page["items"]] == ["alpha"]
    api.post(f"/api/v1/jobs/{created[1]['id']}/cancel")
    page = api.get("/api/v1/jobs", params={"status": ["cancelled"]}).json()
    assert [j["name"] for j in page["items"]] == ["beta"]
    assert api.get("/api/v1/jobs", params={"name": "amm"}).json()["total"] == 1
    r = api.get("/api/v1/jobs", params={"status": "sleeping"})
    assert r.status_code == 422 and "sleeping" in r.text
    job = api.get(f"/api/v1/jobs/{created[0]['id']}").json()
    assert job["name"] == "alpha" and job["attempts"] == [] and job["resumable"] is False
    r = api.get("/api/v1/jobs/999")
    assert r.status_code == 404 and r.json()["detail"] == "no job 999"
    # a reward service's key written into a spec run by `miles run` is stored (a resume needs it), not shown
    remote = {"url": "http://rm:8000/score", "headers": {"X-Key": "s3cret", "Authorization": "${RM_TOKEN}"}}
    job_id = api.store.create_job("keyed", {"name": "keyed", "rollout": {"reward": "remote", "remote_reward": remote}})
    shown = api.get(f"/api/v1/jobs/{job_id}").json()["spec"]["rollout"]["remote_reward"]
    assert shown["headers"] == {"X-Key": "<redacted>", "Authorization": "${RM_TOKEN}"} and "s3cret" not in str(shown)
    assert api.store.job(job_id).spec["rollout"]["remote_reward"]["headers"]["X-Key"] == "s3cret"


def field_errors(response) -> dict[str, str]:
    assert response.status_code == 422, response.text
    return {".".join(map(str, e["loc"])): e["msg"] for e in response.json()["detail"]}


def test_bad_input_gets_4xx_naming_the_problem(api):
    r = httpx.post(api.url + "/api/v1/jobs", headers={**api.admin, "content-type": "application/json"}, content=b"{no")
    assert r.status_code == 422 and "JSON decode error" in r.text
    assert "body.extra" in field_errors(api.post("/api/v1/jobs", json={"spec": {"name": "x"}, "extra": 1}))
    errors = field_errors(api.post("/api/v1/jobs", json={"spec": {"name": "x", "rollout": {"bogus": 1}}}))
    assert "body.spec.rollout.bogus" in errors and "Extra inputs" in errors["body.spec.rollout.bogus"]
    spec = {"name": "x", "schedule": {"type": "fully_async", "max_stalenes": 2}, "rollout": {"num_prompts_per_stp": 2}}
    errors = field_errors(api.post("/api/v1/jobs", json={"spec": spec}))
    assert errors["body.spec.schedule.max_stalenes"].endswith("did you mean 'max_staleness'?"), errors
    assert errors["body.spec.rollout.num_prompts_per_stp"].endswith("did you mean 'num_prompts_per_step'?"), errors
    errors = field_errors(api.post("/api/v1/jobs", json={"spec": {"name": "x", "schedule": {"num_steps": "many"}}}))
    assert "body.spec.schedule.num_steps" in errors
    assert "body.spec" in field_errors(api.post("/api/v1/jobs", json={"spec": []}))
    r = api.post("/api/v1/jobs", json={"spec": {"name": "x" * (2 << 20)}})
    assert r.status_code == 413 and "over the limit" in r.json()["detail"]

    def policy(spec):
        return field_errors(api.post("/api/v1/jobs", json={"spec": {"name": "x", **spec}}))

    assert "outside" in policy({"model": {"source": "path", "path": "../../etc"}})["body.spec.model.path"]
    assert "outside" in policy({"data": {"source": "file", "path": "/etc/passwd"}})["body.spec.data.path"]
    assert "outside" in policy({"output_dir": "/tmp/elsewhere"})["body.spec.output_dir"]
    critic = policy({"train": {"algorithm": "ppo", "critic": {"model": "/etc"}}})  # a folder the trainer would read
    assert "critic folder '/etc' is outside" in critic["body.spec.train.critic.model"]
    template = policy({"data": {"chat_template": "/etc/shadow"}})  # the driver would read the file
    assert "chat template '/etc/shadow' is outside" in template["body.spec.data.chat_template"]
    assert "leave `store` out" in policy({"store": {"url": "sqlite:////tmp/other.db"}})["body.spec.store"]
    assert "leave `ray.address` out" in policy({"ray": {"address": "10.0.0.1:6379"}})["body.spec.ray.address"]
    assert "unknown reward 'os:system'" in policy({"rollout": {"reward": "os:system"}})["body.spec.rollout.reward"]
    extra = policy({"rollout": {"engine": {"type": "sglang", "extra_args": ["--model-path", "/"]}}})
    assert "not accepted" in extra["body.spec.rollout.engine.extra_args"]
    assert "reserves 9 CPUs" in policy({"train": {"backend": {"type": "fsdp2", "world_size": 17}}})["body.spec.ray"]
    urls = policy({"rollout": {"engine": {"type": "sglang", "urls": ["http://169.254.169.254"]}}})
    assert "not accepted" in urls["body.spec.rollout.engine.urls"]
    assert "leave it out" in policy({"sync": {"dir": "runs"}})["body.spec.sync.dir"]
    rendezvous = policy({"sync": {"transport": "broadcast", "master_address": "8.8.8.8", "master_port": 80}})
    assert "rendezvous" in rendezvous["body.spec.sync.master_address"]  # the policy of engine `urls`
    assert "rendezvous" in rendezvous["body.spec.sync.master_port"]
    # the server's limits (ServerSettings.limits), named with the setting that raises them
    huge = policy({"train": {"backend": {"type": "fsdp2", "world_size": 1_000_000}}, "schedule": {"num_steps": 1e12},
                   "model": {"hidden_size": 1e9}, "rollout": {"engine": {"type": "sglang", "num_engines": 1_000_000,
                   "max_total_tokens": 1e15}}})  # fmt: skip
    assert "above this server's limit of 16 (MILES_LIMITS__WORLD_SIZE)" in huge["body.spec.train.backend.world_size"]
    assert "limit of 100000 (MILES_LIMITS__NUM_STEPS)" in huge["body.spec.schedule.num_steps"]
    assert "MILES_LIMITS__HIDDEN_SIZE" in huge["body.spec.model.hidden_size"]
    assert "MILES_LIMITS__NUM_ENGINES" in huge["body.spec.rollout.engine.num_engines"]
    assert "MILES_LIMITS__MAX_TOTAL_TOKENS" in huge["body.spec.rollout.engine.max_total_tokens"]
    free = policy({"ray": {"trainer_cpus_per_rank": 0, "rollout_cpus": 0}})  # would bypass the CPU reservation
    assert "below this server's minimum of 0.1" in free["body.spec.ray.trainer_cpus_per_rank"]
    assert "MILES_LIMITS__MIN_ROLLOUT_CPUS" in free["body.spec.ray.rollout_cpus"]
    r = httpx.post(
        api.url + "/api/v1/jobs",
        headers={**api.admin, "content-type": "application/json"},
        content=b'{"spec": {"name": "x", "train": {"optimizer": {"lr": Infinity}}}}',
    )
    assert "body.spec.train.optimizer.lr" in field_errors(r)
    assert api.get("/api/v1/jobs", params={"limit": 0}).status_code == 422
    assert api.get("/api/v1/jobs/0").status_code == 422
    assert api.get(f"/api/v1/jobs/{2**40}").status_code == 422
    assert api.get("/api/v1/jobs", params={"name": "a\x00b"}).status_code == 422
    assert api.store.jobs()[1] == 0  # nothing was stored by any of these


def test_lifecycle_and_schedule_changes(api):
    job = api.create("life", schedule={"type": "fully_async", "update_weights_interval": 2, "max_staleness": 1})
    url = f"/api/v1/jobs/{job['id']}"
    r = api.patch(url + "/schedule", json={"max_staleness": 3, "pause_mode": "retract"})
    assert r.status_code == 202 and r.json()["status"] == "pending" and r.json()["patch"]["max_staleness"] == 3
    assert "max_staleness" in api.patch(url + "/schedule", json={"max_staleness": 0}).text  # < interval − 1
    assert api.patch(url + "/schedule", json={}).status_code == 422
    assert "body.num_steps" in field_errors(api.patch(url + "/schedule", json={"num_steps": 5}))
    assert [c["patch"] for c in api.get(url + "/schedule-changes").json()] == [
        {"max_staleness": 3, "pause_mode": "retract"}
    ]
    assert api.post(url + "/cancel").json()["status"] == "cancelled"
    r = api.post(url + "/cancel")
    assert r.status_code == 409 and "is cancelled; it cannot become cancelled" in r.json()["detail"]
    assert api.patch(url + "/schedule", json={"max_staleness": 3}).status_code == 409
    resumed = api.post(url + "/resume").json()
    assert resumed["status"] == "queued" and resumed["error"] is None
    r = api.post(url + "/resume")
    assert r.status_code == 409 and "is queued" in r.json()["detail"]
    api.store.set_status(job["id"], JobStatus.STARTING)
    api.store.set_status(job["id"], JobStatus.RUNNING)
    running = api.post(url + "/cancel").json()
    assert running["status"] == "running" and running["cancel_requested"] is True  # the launcher stops it
    kinds = [e["kind"] for e in api.get(url + "/events").json()]
    assert kinds.count("status") == 4 and kinds[-1] == "cancel"


def test_records_and_the_event_stream(api):
    job_id = api.create("reads")["id"]
    store = api.store
    store.set_status(job_id, JobStatus.STARTING)
    store.set_status(job_id, JobStatus.RUNNING)
    for step in (1, 2, 3):
        store.add_metrics(job_id, step, {"train/loss": 1.0 / step, "eval/accuracy": step / 10})
        store.add_spans(job_id, [dict(stage="train", step=step, worker="trainer", start=step, end=step + 0.5)])
        store.add_spans(job_id, [dict(stage="rollout", step=step, worker="rollout-0", start=step, end=step + 0.2)])
        store.add_step(job_id, step, step, float(step), step + 1.0)
    store.add_samples(job_id, 2, [dict(prompt="1+1=", response="2", label="2", reward=1.0, status="completed")])
    url = f"/api/v1/jobs/{job_id}"
    points = api.get(url + "/metrics", params={"name": "train/loss", "step_min": 2}).json()
    assert [(p["step"], p["value"]) for p in points] == [(2, 0.5), (3, 1 / 3)]
    assert api.get(url + "/metric-names").json() == ["eval/accuracy", "train/loss"]
    spans = api.get(url + "/spans", params={"stage": "train", "step_max": 2}).json()
    assert [(s["step"], s["end"] - s["start"]) for s in spans] == [(1, 0.5), (2, 0.5)]
    assert [s["step"] for s in api.get(url + "/steps").json()] == [1, 2, 3]
    [sample] = api.get(url + "/samples", params={"step": 2}).json()
    assert sample["response"] == "2" and sample["reward"] == 1.0
    assert api.get(url).json()["last_step"] == 3
    # the one summary: steps 1-3 each [step, step + 1]: wall 3 s, train 3 × 0.5 s, rollout 3 × 0.2 s
    summary = api.get(url + "/summary").json()
    assert summary["num_steps"] == 3 and summary["wall_s"] == 3.0
    assert {st["stage"]: st["total_s"] for st in summary["stages"]} == {"rollout": pytest.approx(0.6), "train": 1.5}
    assert summary["trainer_busy_s"] == 1.5 and summary["ratio_to_ideal"] == 0.5
    assert summary["eval_accuracy"] == [[1, 0.1], [2, 0.2], [3, 0.3]]
    assert api.get("/api/v1/jobs/999999/summary").status_code == 404
    events = api.get(url + "/events").json()
    store.add_event(job_id, "note", "hello", data={"x": 1})
    store.set_status(job_id, JobStatus.SUCCEEDED)
    assert [e["kind"] for e in api.get(url + "/events", params={"after_id": events[-1]["id"]}).json()] == [
        "note",
        "status",
    ]
    # Server-sent events: everything after Last-Event-ID, then `end` because the job is final.
    with httpx.stream(
        "GET", api.url + url + "/events/stream", headers={**api.read, "Last-Event-ID": str(events[-1]["id"])}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = "".join(r.iter_text())
    blocks = [b for b in body.strip().split("\n\n") if b]
    kinds = [next(line for line in b.split("\n") if line.startswith("event: ")) for b in blocks]
    assert kinds == ["event: note", "event: status", "event: end"]
    assert json.loads(blocks[0].split("data: ", 1)[1])["data"] == {"x": 1}
    assert json.loads(blocks[-1].split("data: ", 1)[1]) == {"status": "succeeded"}
    r = api.get(url + "/logs")
    assert r.status_code == 404 and "no attempt yet" in r.json()["detail"]


def test_operation_ids_are_stable(api):
    spec = httpx.get(api.url + "/openapi.json").json()
    ids = sorted(op["operationId"] for path in spec["paths"].values() for op in path.values())
    assert ids == sorted(
        """cancel_job create_job get_events get_job get_logs get_metrics get_report get_report_file get_samples get_spans
        get_steps get_summary health list_reports
        list_attempts list_checkpoints list_jobs list_log_sources list_metric_names list_presets list_schedule_changes
        patch_schedule
        prometheus_metrics resume_job stream_events validate_job""".split()
    )
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_rewards_over_the_api_are_functions_of_allowed_modules_only(tmp_path, monkeypatch):
    """Checked from the module's source: the server never imports (runs) a plug-in module."""
    import sys

    from miles_control.service.api.policy import check_spec
    from miles_control.service.settings import ServerSettings
    from miles_control.spec.config import JobSpec

    plugin = tmp_path / "plug"
    (plugin / "pkg").mkdir(parents=True)
    (plugin / "pkg" / "__init__.py").write_text("open(__file__ + '.imported', 'w').close()\n")
    (plugin / "pkg" / "scores.py").write_text(
        "import os.path\n"
        "from os.path import join\n"
        "open(__file__ + '.imported', 'w').close()  # what a heavy import would cost the server\n"
        "def score(sample, scale=1.0):\n    return 1.0\n"
        "async def ascore(sample):\n    return 1.0\n"
        "def pair(a, b):\n    return 1.0\n"
        "class Scorer:\n    def __call__(self, sample):\n        return 1.0\n"
        "alias = score\n"
    )
    monkeypatch.syspath_prepend(str(plugin))

    def problems(reward: str, modules: list[str]) -> list[str]:
        spec = JobSpec.model_validate({"name": "x", "rollout": {"reward": reward}})
        return [p["msg"] for p in check_spec(spec, ServerSettings(plugin_modules=modules, cpus=4))[1]]

    assert problems("exact_match", []) == []  # registered
    assert problems("pkg.scores:score", ["pkg"]) == []  # a function of an allowed module
    assert problems("pkg.scores.ascore", ["pkg.scores"]) == []
    assert "is a class, not a function" in problems("pkg.scores:Scorer", ["pkg"])[0]
    assert "must take 1 positional argument(s); it takes 2" in problems("pkg.scores:pair", ["pkg"])[0]
    assert "defines no function 'join'" in problems("pkg.scores:join", ["pkg"])[0]  # imported from elsewhere
    assert "defines no function 'alias'" in problems("pkg.scores:alias", ["pkg"])[0]
    assert "defines no function 'nope'" in problems("pkg.scores:nope", ["pkg"])[0]
    assert "cannot find module 'pkg.missing'" in problems("pkg.missing:f", ["pkg"])[0]
    assert "unknown reward" in problems("pkg.scores:score", [])[0]  # not an allowed module
    assert "unknown reward" in problems("pkg.scores:os.path", ["pkg"])[0]  # a path through the module
    assert "unknown reward" in problems("pkgx:score", ["pkg"])[0]  # a prefix is not a module
    assert not list(plugin.rglob("*.imported")) and "pkg" not in sys.modules  # nothing was run


def test_generate_functions_and_environments_over_the_api_are_of_allowed_modules_only(tmp_path, monkeypatch):
    """Like rewards: built-in names, or a top-level function (an environment: a class too) of an allowed module,
    read from its source, never imported."""
    import sys

    from miles_control.service.api.policy import check_spec
    from miles_control.service.settings import ServerSettings
    from miles_control.spec.config import JobSpec

    plugin = tmp_path / "plug"
    (plugin / "agents").mkdir(parents=True)
    (plugin / "agents" / "__init__.py").write_text("")
    (plugin / "agents" / "loop.py").write_text(
        "open(__file__ + '.imported', 'w').close()\n"
        "async def generate(record, client, sampling, ctx):\n    return None\n"
        "async def short(record, client):\n    return None\n"
        "class Calculator:\n    def reset(self, record): ...\n    def step(self, action): ...\n"
        "def make_env(level, seed=0):\n    return Calculator()\n"
        "def sync_generate(record, client, sampling, ctx):\n    return None\n"
    )
    monkeypatch.syspath_prepend(str(plugin))

    def problems(rollout: dict, modules: list[str]) -> list[tuple[str, str]]:
        spec = JobSpec.model_validate({"name": "x", "rollout": rollout})
        return [(p["loc"][-1], p["msg"]) for p in check_spec(spec, ServerSettings(plugin_modules=modules, cpus=4))[1]]

    assert problems({"generate": "multi_turn", "environment": "agents.loop:Calculator"}, ["agents"]) == []
    assert problems({"generate": "agents.loop:generate", "environment": "agents.loop:make_env"}, ["agents"]) == []
    [(field, msg)] = problems({"generate": "agents.loop:sync_generate"}, ["agents"])
    assert field == "generate" and "is a plain function, not an async one" in msg
    [(field, msg)] = problems({"generate": "agents.loop:short"}, ["agents"])
    assert field == "generate" and "must take 4 positional argument(s); it takes 2" in msg
    [(field, msg)] = problems({"generate": "multi_turn", "environment": "agents.loop:Calculator"}, [])
    assert field == "environment" and "unknown environment 'agents.loop:Calculator'" in msg
    [(field, msg)] = problems({"generate": "agents.loop:generate"}, ["other"])
    assert field == "generate" and "use one of multi_turn, single_turn, supervised; or a function of other" in msg
    assert not list(plugin.rglob("*.imported")) and "agents" not in sys.modules
    [(field, msg)] = problems({"reward": "remote", "remote_reward": {"url": "http://10.0.0.1/score"}}, [])
    assert field == "remote_reward" and "not accepted over the API" in msg


def test_a_user_objective_over_the_api_is_a_class_of_an_allowed_module(tmp_path, monkeypatch):
    """train.algorithm: a built-in, or a class of an allowed module read from its source, never imported."""
    import sys

    from miles_control.service.api.policy import check_spec
    from miles_control.service.settings import ServerSettings
    from miles_control.spec.config import JobSpec

    plugin = tmp_path / "plug"
    (plugin / "algos").mkdir(parents=True)
    (plugin / "algos" / "__init__.py").write_text("open(__file__ + '.imported', 'w').close()\n")
    (plugin / "algos" / "mine.py").write_text("class Mine:\n    name = 'mine'\n")
    monkeypatch.syspath_prepend(str(plugin))

    def problems(algorithm: str, modules: list[str]) -> list[tuple[tuple, str]]:
        spec = JobSpec.model_validate({"name": "x", "train": {"algorithm": algorithm}})
        found = check_spec(spec, ServerSettings(plugin_modules=modules, cpus=4))[1]
        return [(tuple(p["loc"][2:]), p["msg"]) for p in found]

    assert problems("gspo", []) == [] and problems("algos.mine:Mine", ["algos"]) == []
    [(loc, msg)] = problems("algos.mine:Mine", [])
    assert loc == ("train", "algorithm", "name") and "unknown algorithm 'algos.mine:Mine': use one of grpo" in msg
    [(loc, msg)] = problems("algos.mine:Other", ["algos"])
    assert loc == ("train", "algorithm", "name") and "Other" in msg
    assert not list(plugin.rglob("*.imported")) and "algos" not in sys.modules


def test_limits_are_server_settings(monkeypatch):
    from miles_control.service.api.policy import check_spec
    from miles_control.service.settings import ServerSettings
    from miles_control.spec.config import JobSpec

    spec = JobSpec.model_validate({"name": "x", "train": {"backend": {"type": "fsdp2", "world_size": 2}}})
    assert check_spec(spec, ServerSettings(cpus=4))[1] == []
    monkeypatch.setenv("MILES_LIMITS__WORLD_SIZE", "1")
    [problem] = check_spec(spec, ServerSettings(cpus=4))[1]
    assert problem["loc"] == ["body", "spec", "train", "backend", "world_size"]
    assert problem["msg"] == "2 is above this server's limit of 1 (MILES_LIMITS__WORLD_SIZE)"


def test_a_plan_needing_more_gpus_than_the_server_has_is_refused_at_submission(monkeypatch):
    from miles_control.service.api.policy import check_spec, local_gpus
    from miles_control.service.settings import ServerSettings
    from miles_control.spec.config import JobSpec

    def problems(settings: ServerSettings, **fields) -> list[dict]:
        spec = JobSpec.model_validate({"name": "x", "train": {"backend": {"type": "fsdp2", "world_size": 2}}} | fields)
        return check_spec(spec, settings)[1]

    two = ServerSettings(cpus=4, gpus=2)
    assert problems(two, rollout={"engine": {"type": "hf"}}) == []  # auto: a GPU per rank, 2 of 2
    sglang = {"engine": {"type": "sglang", "num_engines": 2, "device": "cuda"}}
    [problem] = problems(two, rollout=sglang)  # + 2 engines × 1 GPU
    assert problem["loc"] == ["body", "spec", "resources"]
    assert problem["msg"].startswith("resources: the plan needs 4 GPU(s) (trainer 2 × 1 + rollout 2 engine(s) × 1) "
                                      "but this server (MILES_GPUS) has 2")  # fmt: skip
    assert problems(ServerSettings(cpus=4, gpus=4), rollout=sglang) == []
    colocated = {"mode": "colocated"}
    [problem] = problems(ServerSettings(cpus=4, gpus=0), resources=colocated, rollout=sglang)
    assert "resources.mode: colocated shares GPUs" in problem["msg"]
    # without MILES_GPUS a local server counts this machine's GPUs (Ray's view of them): CUDA_VISIBLE_DEVICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert local_gpus() == 3
    hf = {"engine": {"type": "hf"}}
    [problem] = problems(ServerSettings(cpus=4), resources={"trainer_gpus_per_rank": 2}, rollout=hf)
    assert "needs 4 GPU(s) (trainer 2 × 2) but this machine has 3" in problem["msg"]
    for visible, count in (("0,-1,1", 1), ("NoDevFiles", 0), ("GPU-3b2f,GPU-77aa", 2)):  # CUDA stops at "-1"
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert local_gpus() == count, visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert local_gpus() == 0 and problems(ServerSettings(cpus=4)) == []  # no GPU: the CPU-only plan


def test_metrics_labels_stay_bounded(api):
    """Random methods and paths cannot grow the number of Prometheus series: unknown methods and unmatched
    paths share one label each."""
    import random
    import string

    def series() -> set[str]:
        text = api.get("/metrics").text
        return {line.split(" ")[0] for line in text.splitlines() if line.startswith("miles_http_requests_total{")}

    rng = random.Random(0)
    for _ in range(60):
        method = "".join(rng.choices(string.ascii_uppercase, k=6))
        path = "/" + "".join(rng.choices(string.ascii_lowercase, k=8))
        httpx.request(method, api.url + path, headers=api.read, timeout=30)
        httpx.request(method, api.url + "/api/v1/jobs", headers=api.read, timeout=30)
    grown = {s for s in series() if 'method="other"' in s or 'path="other"' in s}
    assert 1 <= len(grown) <= 4, grown  # (other method or GET) × other path, × the few statuses they get
    assert all(any(f'method="{m}"' in s for m in ("GET", "other")) for s in grown)


def _stream_lines(api, job_id: int, headers: dict, out: list, opened: threading.Event) -> None:
    """Read a job's event stream into `out` (one entry per line) until the server ends it."""
    try:
        with httpx.stream("GET", f"{api.url}/api/v1/jobs/{job_id}/events/stream", headers=headers, timeout=120) as r:
            out.append(f"status {r.status_code}")
            opened.set()
            for line in r.iter_lines():
                out.append(line)
    except httpx.HTTPError as exc:
        out.append(f"error {type(exc).__name__}")
    finally:
        opened.set()


def test_an_open_stream_ends_when_its_token_is_revoked(api):
    """(The fixture's server trusts a token for 0 s: the stream re-checks it every second.)"""
    job_id = api.create("watched")["id"]  # queued, never final: the stream would stay open
    lines: list[str] = []
    opened = threading.Event()
    reader = threading.Thread(target=_stream_lines, args=(api, job_id, api.read, lines, opened), daemon=True)
    reader.start()
    assert opened.wait(30) and lines[0] == "status 200"
    time.sleep(1.5)
    assert reader.is_alive()  # still open while the token is valid
    revoke_token(api.store, api.read_token_id)
    reader.join(timeout=15)
    assert not reader.is_alive(), "the stream outlived its revoked token"
    assert "event: unauthorized" in lines and any("invalid or revoked token" in line for line in lines)


def test_sigterm_ends_open_streams_and_the_server(store_url, tmp_path):
    """An open /events/stream no longer holds `miles serve` after SIGTERM: the stream ends with `shutdown`
    and the process exits (both stores)."""
    from miles_control.service.store.tokens import create_token
    from miles_control.testing.servers import ApiServer

    store = Store(store_url)
    _, secret = create_token(store, "reader", "read")
    job_id = store.create_job("watched", {"name": "watched"})
    server = ApiServer(store_url, tmp_path, launcher="off", poll_interval_s="0.2", cpus="2").start()
    try:
        lines: list[str] = []
        opened = threading.Event()
        headers = {"Authorization": f"Bearer {secret}"}
        reader = threading.Thread(target=_stream_lines, args=(server, job_id, headers, lines, opened), daemon=True)
        reader.start()
        assert opened.wait(30) and lines[0] == "status 200"
        time.sleep(1.0)
        start = time.monotonic()
        server.proc.terminate()
        server.proc.wait(timeout=30)
        stopped_s = time.monotonic() - start
        reader.join(timeout=10)
        assert "event: shutdown" in lines, lines
        assert stopped_s < 10, f"miles serve took {stopped_s:.1f} s to stop with a stream open"
    finally:
        server.stop()
        store.engine.dispose()


def test_hostile_bodies_get_4xx_not_500(api, tmp_path):
    """Each of these answered 500 before: the symlink loop, the lone surrogates and the deep nesting."""
    import os

    raw = {**api.admin, "content-type": "application/json"}

    def send(content: bytes) -> httpx.Response:
        return httpx.post(api.url + "/api/v1/jobs", headers=raw, content=content, timeout=30)

    (tmp_path / "data").mkdir(exist_ok=True)
    os.symlink(tmp_path / "data" / "loop", tmp_path / "data" / "loop")
    errors = field_errors(api.post("/api/v1/jobs", json={"spec": {"name": "x", "data": {"path": "loop"}}}))
    assert "cannot be resolved" in errors["body.spec.data.path"]
    r = send(b'{"spec": {"name": "\\ud800"}}')  # a lone surrogate: no database can store it
    assert r.status_code == 422 and "lone surrogate" in r.text and "\\\\ud800" in r.text  # echoed escaped
    assert send(b'{"spec": {"name": "x", "\\udfff": 1}}').status_code == 422  # also in a key
    for depth in (33, 500, 980, 50_000):
        r = send(b'{"spec": {"name": "x", "seed": ' + b"[" * depth + b"]" * depth + b"}}")
        assert r.status_code == 400 and "nests deeper than 32 levels" in r.json()["detail"], (depth, r.text)
    assert (
        send(b'{"spec": {"name": "x", "seed": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}}').status_code == 422
    )  # in a string
    r = send(b'{"spec": {"name": "\xff\xfe"}}')
    assert r.status_code == 400 and "not UTF-8" in r.json()["detail"]
    errors = field_errors(api.post("/api/v1/jobs", json={"spec": {"name": "x" * 201}}))  # the store's column
    assert "at most 200 characters" in errors["body.spec.name"]
    chunks = (b" " * 65536 for _ in range(20))  # no Content-Length: counted as it streams in
    r = httpx.post(api.url + "/api/v1/jobs", headers=raw, content=chunks, timeout=30)
    assert r.status_code == 413 and "over the limit" in r.json()["detail"]
    job = api.create("streamed")["id"]
    with httpx.stream(
        "GET", f"{api.url}/api/v1/jobs/{job}/events/stream", headers={**api.read, "Last-Event-ID": "9" * 5000}
    ) as r:
        assert r.status_code == 200
    assert api.store.jobs()[1] == 1  # only the one valid job was stored


def test_engine_logs_are_served_only_from_where_the_server_put_or_confined_them(api, tmp_path):
    """An SGLang server's log (`get_logs?source=engine-<i>`): from the launcher's folder beside the driver's log; a
    link there that leads elsewhere is not served; a spec's own rollout.engine.log_dir only for a job created over
    the API (whose policy confined it) and only for its latest attempt."""
    from miles_control.service.launch.drivers import engine_log_dir

    def attempt_logging_to(job_id: int, log_path: Path) -> None:
        for live in api.store.attempts(job_id, live_only=True):  # one live attempt per job: a resume ends the last
            api.store.end_attempt(live.id, "replaced")
        attempt = api.store.start_attempt(job_id, "local")
        api.store.update_attempt(attempt.id, log_path=str(log_path))

    sglang = {"engine": {"type": "sglang"}}
    launched = api.create("launched", rollout=sglang)["id"]
    log_path = tmp_path / "logs" / f"job-{launched}" / "attempt-1.log"
    folder = engine_log_dir(log_path)
    folder.mkdir(parents=True)
    log_path.write_text("driver\n")
    (folder / "sglang-0.log").write_text("server 0 ready\n")
    # server 0 crashed and was restarted twice: each process kept its own log
    (folder / "sglang-0.restart-1.log").write_text("restart 1 ready\n")
    (folder / "sglang-0.restart-2.log").write_text("restart 2 ready\n")
    (folder / "sglang-0.port-4242.log").write_text("lost its port\n")  # a start-up retry: not a server's log
    secret = tmp_path / "secret.txt"
    secret.write_text("not a log\n")
    (folder / "sglang-1.log").symlink_to(secret)
    attempt_logging_to(launched, log_path)
    url = f"/api/v1/jobs/{launched}/logs"
    sources = api.get(url + "/sources").json()
    assert [s["name"] for s in sources] == ["driver", "engine-0", "engine-0.restart-1", "engine-0.restart-2"]
    assert sources[2]["description"] == "SGLang server 0, after restart 1"
    assert api.get(url, params={"source": "engine-0"}).text == "server 0 ready\n"
    assert api.get(url, params={"source": "engine-0.restart-2"}).text == "restart 2 ready\n"
    assert api.get(url, params={"source": "engine-0.restart-3"}).status_code == 404
    r = api.get(url, params={"source": "engine-1"})
    assert r.status_code == 404 and "no engine-1 log" in r.json()["detail"]
    r = api.get(url, params={"source": "../secret"})
    assert r.status_code == 422  # not a source's name

    # a job stored outside the API (`miles run --store`) names a folder no policy checked: not served
    spec = JobSpec.model_validate({"name": "cli", "rollout": {"engine": {"type": "sglang", "log_dir": str(folder)}}})
    cli = api.store.create_job("cli", spec.model_dump(mode="json"), source="cli")
    attempt_logging_to(cli, tmp_path / "cli.log")
    r = api.get(f"/api/v1/jobs/{cli}/logs", params={"source": "engine-0"})
    assert r.status_code == 404 and "not created over the API" in r.json()["detail"]
    assert [s["name"] for s in api.get(f"/api/v1/jobs/{cli}/logs/sources").json()] == ["driver"]

    # an API job's own (confined) log_dir holds its latest attempt's logs: an earlier attempt's were overwritten
    own = api.create("own-dir", rollout={"engine": {"type": "sglang", "log_dir": "engine-logs"}})
    own_dir = Path(own["spec"]["rollout"]["engine"]["log_dir"])
    own_dir.mkdir(parents=True)
    (own_dir / "sglang-0.log").write_text("attempt 2's server\n")
    for n in (1, 2):
        attempt_logging_to(own["id"], tmp_path / f"own-{n}.log")
    url = f"/api/v1/jobs/{own['id']}/logs"
    assert api.get(url, params={"source": "engine-0"}).text == "attempt 2's server\n"
    r = api.get(url, params={"source": "engine-0", "attempt": 1})
    assert r.status_code == 404 and "replaced by a later one" in r.json()["detail"]


def test_datasets_hub_ids_map_functions_and_trackers_over_the_api(tmp_path, monkeypatch):
    """data.source hf: a Hub id is kept for the server's Hugging Face cache, a local path is confined to the data
    root; data.map is a function of an allowed module (read, not imported); a tracker writes under the runs folder
    and names no host (no tracking_uri)."""
    from miles_control.service.api.policy import check_spec
    from miles_control.service.settings import ServerSettings
    from miles_control.spec.config import JobSpec

    plugin = tmp_path / "plug"
    (plugin / "rows").mkdir(parents=True)
    (plugin / "rows" / "__init__.py").write_text("def shape(row):\n    return row\n")
    monkeypatch.syspath_prepend(str(plugin))
    data_root = tmp_path / "data"
    (data_root / "local" / "set").mkdir(parents=True)
    settings = ServerSettings(data_root=data_root, data_dir=tmp_path / "state", plugin_modules=["rows"], cpus=4)
    runs = settings.runs_root

    def check(data: dict, tracking: list | None = None) -> tuple[JobSpec, list[str]]:
        spec = JobSpec.model_validate({"name": "x", "data": {"source": "hf", **data}, "tracking": tracking or []})
        checked, problems = check_spec(spec, settings)
        return checked, [p["msg"] for p in problems]

    spec, problems = check({"path": "org/dataset"})
    assert problems == [] and spec.data.path == "org/dataset"  # a Hub id
    spec, problems = check({"path": "local/set"})
    assert problems == [] and spec.data.path == str((data_root / "local" / "set").resolve())  # a folder there
    assert "is outside" in check({"path": "/etc/*.csv"})[1][0]
    assert check({"path": "org/dataset", "map": "rows:shape"})[1] == []
    assert "unknown map 'os:system'" in check({"path": "org/dataset", "map": "os:system"})[1][0]
    spec, problems = check({"path": "org/dataset"}, [{"type": "tensorboard", "dir": "tb"}, "wandb"])
    assert problems == [] and spec.tracking[0].dir == str((runs / "tb").resolve())
    assert "is outside" in check({"path": "org/dataset"}, [{"type": "tensorboard", "dir": "/tmp"}])[1][0]
    refused = check({"path": "org/dataset"}, [{"type": "mlflow", "tracking_uri": "http://10.0.0.1"}])[1]
    assert "a tracking URI is not accepted over the API" in refused[0]


def test_a_wrong_kind_over_the_api_reports_its_sections_other_errors(api):
    spec = {"name": "x", "schedule": {"type": "syncc", "num_steps": -1}}
    errors = field_errors(api.post("/api/v1/jobs/validate", json={"spec": spec}))
    assert "does not match any of the expected tags" in errors["body.spec.schedule"], errors
    assert errors["body.spec.schedule.num_steps"] == "Input should be greater than 0", errors
