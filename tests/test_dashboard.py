"""The dashboard's pages (streamlit AppTest) against a real `miles serve` (launcher off) on a seeded store."""

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from streamlit.testing.v1 import AppTest

from miles_control.service.store import JobStatus, Store
from miles_control.service.store.tokens import create_token
from miles_control.spec.config import JobSpec
from miles_control.testing.servers import ApiServer

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "dashboard" / "src" / "miles_dashboard" / "app.py"


def seed_run(store: Store, name: str, schedule: str, num_steps: int, final: JobStatus, **fields) -> int:
    spec = JobSpec(name=name, schedule={"type": schedule, "num_steps": num_steps}, **fields).model_dump(mode="json")
    # created `starting`, as `miles run` creates its own: a launcher serving this store never takes a seeded run
    job = store.create_job(name, spec, source="api", status=JobStatus.STARTING)
    store.set_status(job, JobStatus.RUNNING)
    t = time.time() - 100
    for step in range(1, 6):
        base = t + step * 4
        store.add_spans(
            job,
            [
                dict(stage="rollout", step=step, worker="rollout-0", start=base, end=base + 1.5, num_tokens=500),
                dict(stage="reward", step=step, worker="rollout-0", start=base + 1.5, end=base + 1.6),
                dict(stage="train", step=step, worker="trainer", start=base + 1.6, end=base + 3.0, num_tokens=800),
                dict(stage="weight_sync", step=step, worker="trainer->rollout-0", start=base + 3.0, end=base + 3.05,
                     num_bytes=4_000_000, attrs={"transport": "disk"}),
            ],
        )  # fmt: skip
        store.add_step(job, step, step, base, base + 3.05)
        store.add_metrics(job, step, {"rollout/reward_mean": 0.1 * step, "train/loss": 1.0 / step,
                                      "rollout/tokens_per_s": 333.0, "train/tokens_per_s": 570.0})  # fmt: skip
        store.add_samples(job, step, [dict(prompt="12+30=", response="42", label="42", reward=1.0, status="completed")])
    store.add_metrics(job, 5, {"eval/accuracy": 0.5})
    if final != JobStatus.RUNNING:
        store.set_status(job, final)
    return job


@pytest.fixture(scope="module")
def dashboard_api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    url = f"sqlite:///{tmp}/miles.db"
    store = Store(url)
    _, token = create_token(store, "dash", "admin")
    done = seed_run(store, "sync-run", "sync", 5, JobStatus.SUCCEEDED)
    # what a job with trackers records (miles_control.job.run): a link per tracker that started, a warning per one that not
    store.add_event(done, "tracking", "wandb: https://wandb.ai/team/miles/runs/abc", None,
                    {"type": "wandb", "link": "https://wandb.ai/team/miles/runs/abc"})  # fmt: skip
    store.add_event(done, "tracking", "tensorboard: /runs/tracking/tensorboard/miles/sync-run-job1", None,
                    {"type": "tensorboard", "link": "/runs/tracking/tensorboard/miles/sync-run-job1"})  # fmt: skip
    store.add_event(done, "tracking", "tracking[2] (mlflow) cannot start", None, {"type": "mlflow", "level": "warning"})
    running = seed_run(store, "async-run", "fully_async", 50, JobStatus.RUNNING)
    server = ApiServer(url, tmp, launcher="off", presets_dir=str(ROOT / "examples")).start()
    yield {"url": server.url, "token": token, "store": store, "done": done, "running": running}
    server.stop()


@pytest.fixture
def app(dashboard_api, monkeypatch):
    monkeypatch.setenv("MILES_API_URL", dashboard_api["url"])
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["token"] = dashboard_api["token"]  # what signing in through the sidebar stores
    return at


def texts(at: AppTest) -> str:
    return "\n".join([m.value for m in at.markdown] + [m.value for m in at.caption] + [t.value for t in at.title])


def gutter(at: AppTest) -> tuple[list[int], list[int]]:
    """The launch editor's gutter, read back from its SVG: the line numbers drawn, and the lines shaded red."""
    import base64

    [style] = [m.value for m in at.markdown if ".st-key-spec_yaml textarea" in m.value]
    svg = base64.b64decode(re.search(r"base64,([A-Za-z0-9+/=]+)", style).group(1)).decode()
    numbers = [int(n) for n in re.findall(r">(\d+)</text>", svg)]
    shaded = [(int(y) - 8) // 21 + 1 for y in re.findall(r'<rect x="0" y="(\d+)" width="4000"', svg)]
    return numbers, shaded


def test_jobs_page_lists_jobs_and_places_api_errors_on_yaml_lines(app, dashboard_api):
    at = app.run()
    assert not at.exception
    [table] = [d for d in at.dataframe]
    assert set(table.value["name"]) == {"sync-run", "async-run"}
    assert set(table.value["status"]) == {"succeeded", "running"}
    assert "2 job(s); 1 active" in texts(at)
    at.multiselect(key="filter_status").set_value(["running"]).run()
    assert list(at.dataframe[0].value["name"]) == ["async-run"]

    at.text_area(key="spec_yaml").set_value("name: bad\nrollout:\n  sampling:\n    top_p: 5\n").run()
    at.button(key="launch").click().run()
    assert "line 4 · `rollout.sampling.top_p`: Input should be less than or equal to 1" in texts(at)
    # the spec numbered, the error's line marked
    assert any("4 >     top_p: 5   # <- Input should be less than or equal to 1" in c.value for c in at.code)
    # and in the editor itself: its gutter numbers every line and shades line 4 (rows 21 px high, 8 px padding)
    numbers, shaded = gutter(at)
    assert numbers[:5] == [1, 2, 3, 4, 5] and shaded == [4]
    before = dashboard_api["store"].jobs()[1]
    at.text_area(key="spec_yaml").set_value("name: typo\nschedule:\n  type: fully_async\n  max_stalenes: 2\n").run()
    at.button(key="validate").click().run()
    # pydantic's "Extra inputs are not permitted" said as what it means in a spec, with the API's suggestion
    assert (
        "line 4 · `schedule.max_stalenes`: not a field of this section (a typo, or a field of another section or "
        "kind); did you mean 'max_staleness'?"
    ) in texts(at)
    at.text_area(key="spec_yaml").set_value("name: fine\nschedule:\n  type: fully_async\n  max_staleness: 2\n").run()
    at.button(key="validate").click().run()
    assert any("Valid: fine would run 300 steps on the fully_async schedule" in s.value for s in at.success)
    assert dashboard_api["store"].jobs()[1] == before  # validating created nothing
    assert gutter(at)[1] == []  # the refused text was edited: nothing shaded any more
    at.text_area(key="spec_yaml").set_value("name: ok\nrollout:\n  sampling: [unclosed\n").run()
    at.button(key="launch").click().run()
    assert any("Invalid YAML: line 4" in e.value for e in at.error)
    assert gutter(at)[1] == [4]  # where the parser stopped
    # the server's presets (its presets_dir), in full; choosing one loads it into the editor
    assert set(at.selectbox(key="preset").options) == {p.stem for p in (ROOT / "examples").glob("*.yaml")}
    at.selectbox(key="preset").set_value("arithmetic").run()
    assert at.text_area(key="spec_yaml").value == (ROOT / "examples" / "arithmetic.yaml").read_text()
    at.selectbox(key="preset").set_value("quick").run()
    assert "name: arithmetic-quick" in at.text_area(key="spec_yaml").value
    at.button(key="launch").click().run()
    assert not at.error, [e.value for e in at.error]
    created = max(j.id for j in dashboard_api["store"].jobs()[0])
    assert dashboard_api["store"].job(created).name == "arithmetic-quick"
    assert f"#{created} arithmetic-quick" in texts(at)  # straight to the new job's page


def test_launch_can_start_from_an_earlier_jobs_spec(app, dashboard_api):
    at = app.run()
    at.radio(key="launch_from").set_value("an earlier job").run()
    at.selectbox(key="clone").set_value(dashboard_api["done"]).run()
    cloned = yaml.safe_load(at.text_area(key="spec_yaml").value)
    assert cloned["name"] == "sync-run-again" and cloned["schedule"]["num_steps"] == 5
    assert "output_dir" not in cloned and "dir" not in cloned["sync"]  # what the server chose for that job
    at.button(key="validate").click().run()
    assert any("Valid: sync-run-again would run 5 steps on the sync schedule" in s.value for s in at.success), [
        e.value for e in at.error
    ]


def test_job_page_shows_timeline_breakdown_sync_samples(app, dashboard_api):
    at = app.run()
    at.switch_page("views/job.py")
    at.session_state["job_id"] = dashboard_api["done"]
    at.run()
    assert not at.exception
    body = texts(at)
    assert "sync-run" in body and "succeeded" in body and "step 5/5" in body
    # the trackers as links (a URL) or a path to copy; the one that did not start is only in the events
    assert ("Tracked in [wandb](https://wandb.ai/team/miles/runs/abc) · tensorboard: "
            "`/runs/tracking/tensorboard/miles/sync-run-job1`") in body  # fmt: skip
    assert "Spans shown: **reward** 5, **rollout** 5, **train** 5, **weight_sync** 5" in body
    # the numbers of the one summary (what `miles run` prints), served by the API: 5 steps of 3.05 s, 4 s apart
    from miles_control.service.summary import summarize

    s = summarize(dashboard_api["store"], dashboard_api["done"])
    assert s.wall_s == pytest.approx(4 * 4 + 3.05) and s.trainer_busy_s == pytest.approx(5 * 1.45)
    assert f"Wall time **{s.wall_s:,.1f} s** (steps 1–5)" in body and "trainer idle 0.0 s" in body
    assert f"achieved / ideal overlap bound **{s.ratio_to_ideal:.2f}**" in body
    assert "5 updates: mean **50.0 ms**" in body and "via `disk`" in body
    assert len(at.get("vega_lite_chart")) >= 4  # metrics, timeline, breakdown, throughput, sync
    samples = [d.value for d in at.dataframe if "response" in d.value.columns]
    assert samples and samples[0]["response"].tolist() == ["42"]
    assert re.search(r"Started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d · ran \d+", body), body  # no ETA: it has ended
    assert "ETA" not in body
    assert "No attempt yet" in "\n".join(i.value for i in at.info)  # the Logs tab of a job seeded without a driver
    assert any("name: sync-run" in c.value and "num_steps: 5" in c.value for c in at.code)  # the Spec tab


def chart_data(chart) -> list:
    """The rows of a chart's datasets (streamlit sends them as Arrow tables beside the spec)."""
    import pyarrow as pa

    frames = [pa.ipc.open_stream(d.data.data).read_all().to_pandas() for d in chart.proto.datasets]
    if chart.proto.HasField("data"):
        frames.append(pa.ipc.open_stream(chart.proto.data.data).read_all().to_pandas())
    return frames


def test_metric_charts_people_can_read(app, dashboard_api):
    store = dashboard_api["store"]
    job = seed_run(store, "charts-run", "one_step_off", 5, JobStatus.SUCCEEDED)
    change = store.request_schedule_change(job, {"update_weights_interval": 2})
    store.resolve_schedule_change(change, "applied", 3, "")
    at = app.run()
    at.switch_page("views/job.py")
    at.session_state["job_id"] = job
    at.run()
    assert not at.exception
    charts = at.get("vega_lite_chart")
    metric = [c for c in charts if '"title": "' in c.proto.spec and '"name": "pick"' in c.proto.spec]
    assert len(metric) >= 2, "one chart per metric"
    for chart in metric:  # each sized by its container, with its own x axis and a unit on its y axis
        spec = json.loads(chart.proto.spec)
        assert spec.get("width") == "container", spec.get("width")
        y_titles = [layer["encoding"]["y"].get("title") for layer in spec["layer"] if "y" in layer.get("encoding", {})]
        assert y_titles[0], f"no unit on {spec.get('title')}"
    grid = next(c for c in metric if '"title": "rollout/reward_mean"' in c.proto.spec)
    timeline = next(c for c in charts if "seconds since the first span shown" in c.proto.spec)
    throughput = next(c for c in charts if "tokens/s" in c.proto.spec and '"name": "pick"' not in c.proto.spec)
    sync = next(c for c in charts if "weight update latency (ms)" in c.proto.spec)
    for chart in (grid, throughput, sync):  # the change, labelled, on every chart against steps
        assert any("update_weights_interval=2 (step 3)" in f.to_string() for f in chart_data(chart)), chart.proto.spec
    starts = [f for f in chart_data(timeline) if "start_s" in f.columns and "worker" not in f.columns]
    assert starts and sorted(starts[0]["step"]) == [1, 2, 3, 4, 5]  # step boundaries on the timeline
    assert at.get("download_button"), "no CSV download"
    at.slider(key="chart_smoothing").set_value(0.5)
    at.toggle(key="chart_log").set_value(True)
    at.radio(key="chart_axis").set_value("wall time")
    at.slider(key=f"chart_steps-{job}").set_value((2, 4)).run()
    assert not at.exception
    grid = next(c for c in at.get("vega_lite_chart") if '"title": "rollout/reward_mean"' in c.proto.spec)
    assert '"type": "log"' in grid.proto.spec and "wall time since the first point (s)" in grid.proto.spec
    [data] = [f for f in chart_data(grid) if "kind" in f.columns]
    reward = data[(data["name"] == "rollout/reward_mean")]
    assert sorted(reward.loc[reward["kind"] == "raw", "step"]) == [2, 3, 4]  # the step range
    smoothed = reward[reward["kind"] == "smoothed"].sort_values("step")["value"].tolist()
    assert smoothed == pytest.approx([0.2, (0.3 + 0.5 * 0.2) / 1.5, (0.4 + 0.5 * 0.3 + 0.25 * 0.2) / 1.75])  # EMA
    at.run()  # a refresh keeps the controls
    assert at.slider(key=f"chart_steps-{job}").value == (2, 4) and at.toggle(key="chart_log").value


def test_samples_are_tied_to_steps(app, dashboard_api):
    store = dashboard_api["store"]
    job = seed_run(store, "samples-run", "sync", 5, JobStatus.SUCCEEDED)
    turns = [{"role": "user", "content": "6*7=?"}, {"role": "assistant", "content": "<call>6*7</call>"},
             {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]  # fmt: skip
    store.add_samples(job, 3, [
        dict(prompt="6*7=", response="42", label="42", reward=1.0, status="completed", num_tokens=3,
             logprobs=[-0.1, -2.5, -0.7], turns=turns),
        dict(prompt="2+2=", response="5", label="4", reward=0.0, status="completed", num_tokens=1, logprobs=[-3.0]),
    ])  # fmt: skip
    at = app.run()
    at.switch_page("views/job.py")
    at.session_state["job_id"] = job
    # what a click on a step-3 point of the reward chart sets
    at.session_state[f"grid-{job}-rollout/reward_mean"] = {"selection": {"pick": [{"step": 3}]}}
    at.run()
    assert not at.exception
    assert "Step 3" in [h.value for h in at.subheader]
    detail = [d.value for d in at.dataframe if "length (tokens)" in d.value.columns]
    assert sorted(detail[0]["reward"]) == [0.0, 1.0, 1.0] and sorted(detail[0]["length (tokens)"].dropna()) == [1, 3]
    at.slider(key=f"reward-step-{job}-3").set_value((0.5, 1.0)).run()  # filter by reward
    detail = [d.value for d in at.dataframe if "length (tokens)" in d.value.columns]
    assert sorted(detail[0]["prompt"]) == ["12+30=", "6*7="]
    at.selectbox(key=f"sample-step-{job}-3").set_value(1).run()  # the one with logprobs and turns
    strips = [c for c in at.get("vega_lite_chart") if "response token" in c.proto.spec]
    assert strips and chart_data(strips[0])[0]["logprob"].tolist() == [-0.1, -2.5, -0.7]
    assert [m.name for m in at.chat_message] == ["user", "assistant", "user", "assistant"]
    assert "**tool**: 42" in "\n".join(md.value for m in at.chat_message for md in m.markdown)


def test_a_samples_images_are_shown_beside_its_text(app, dashboard_api):
    """A vision-language model's sample: the images the recorder stored (thumbnails as data URIs) next to its text."""
    from types import SimpleNamespace

    from miles_control.job.recorder import _thumbnails
    from miles_rollout.tasks.counting import counting_rows

    image = counting_rows(1, seed=0)[0][0]
    stored = _thumbnails(SimpleNamespace(images=[image]))
    assert stored and stored[0].startswith("data:image/png;base64,")
    store = dashboard_api["store"]
    job = seed_run(store, "image-run", "sync", 2, JobStatus.SUCCEEDED)
    store.add_samples(job, 1, [dict(prompt="how many squares?", response="3", label="3", reward=1.0,
                                    status="completed", num_tokens=2, images=stored)])  # fmt: skip
    at = app.run()
    at.switch_page("views/job.py")
    at.session_state["job_id"] = job
    at.session_state[f"grid-{job}-rollout/reward_mean"] = {"selection": {"pick": [{"step": 1}]}}
    at.run()
    assert not at.exception
    box = at.selectbox(key=f"sample-step-{job}-1")
    box.set_value(next(i for i, o in enumerate(box.options) if "how many squares" in o)).run()
    assert len(at.get("image")) == 1  # st.image's element, beside the text
    assert "**response**: 3" in "\n".join(m.value for m in at.markdown)


def test_resources_tab_plots_each_workers_cpu_and_memory(app, dashboard_api):
    store = dashboard_api["store"]
    job = seed_run(store, "resources-run", "sync", 5, JobStatus.SUCCEEDED)
    for step in range(1, 6):
        store.add_metrics(job, step, {"sys/trainer0/cpu_pct": 90.0 + step, "sys/trainer0/rss_mb": 1500.0,
                                      "sys/rollout/cpu_pct": 50.0, "sys/rollout/rss_mb": 2500.0 + step})  # fmt: skip
    at = app.run()
    at.switch_page("views/job.py")
    at.session_state["job_id"] = job
    at.run()
    assert not at.exception
    charts = [c for c in at.get("vega_lite_chart") if "CPU (% of one core)" in c.proto.spec]
    assert charts and set(chart_data(charts[0])[0]["worker"]) == {"trainer0", "rollout"}
    [latest] = [d.value for d in at.dataframe if "rss_mb" in d.value.columns]
    assert latest.loc["rollout", "rss_mb"] == 2505.0 and latest.loc["trainer0", "cpu_pct"] == 95.0


def test_logs_tab_shows_the_driver_and_each_engine_log(app, dashboard_api, tmp_path):
    """An attempt launched locally logs beside the driver's log (`attempt-1-engines/sglang-<i>.log`): the Logs tab
    lists the driver and both SGLang servers, and shows the one chosen."""
    from miles_control.service.launch.drivers import engine_log_dir

    store = dashboard_api["store"]
    job = seed_run(store, "logged-run", "sync", 5, JobStatus.SUCCEEDED, rollout={"engine": {"type": "sglang"}})
    log_path = tmp_path / "logs" / f"job-{job}" / "attempt-1.log"
    engines = engine_log_dir(log_path)
    engines.mkdir(parents=True)
    log_path.write_text("driver: step 5 done\n")
    for i in range(2):
        (engines / f"sglang-{i}.log").write_text(f"server {i}: The server is fired up and ready to roll!\n")
    attempt = store.start_attempt(job, "local")
    store.update_attempt(attempt.id, log_path=str(log_path))
    at = app.run()
    at.switch_page("views/job.py")
    at.session_state["job_id"] = job
    at.run()
    assert not at.exception
    chooser = at.selectbox(key=f"log_source-{job}-1")
    assert chooser.options == ["driver (the driver: the job's own progress and errors, 0 KiB)",
                               "engine-0 (SGLang server 0, 0 KiB)", "engine-1 (SGLang server 1, 0 KiB)"]  # fmt: skip
    assert any("driver: step 5 done" in c.value for c in at.code)
    chooser.set_value("engine-1").run()
    assert any("server 1: The server is fired up" in c.value for c in at.code)
    assert any("The log of SGLang server 1, attempt 1" in c.value for c in at.caption)


def test_job_page_gives_the_eta_of_a_running_job(app, dashboard_api):
    at = app.run()
    at.switch_page("views/job.py")
    at.session_state["job_id"] = dashboard_api["running"]
    at.run()
    assert not at.exception
    # 5 of 50 steps done, one every 4 s: 45 steps × 4 s
    assert "ETA 3 min 00 s (45 steps at 4.0 s a step)" in texts(at)


def test_tune_page_asks_for_confirmation_then_records_the_change(app, dashboard_api):
    at = app.run()
    at.switch_page("views/tune.py")
    at.session_state["job_id"] = dashboard_api["running"]
    at.run()
    assert not at.exception
    assert "async-run" in texts(at)
    assert {n.label for n in at.number_input} == {  # the live fields of a fully_async schedule
        "update_weights_interval", "max_staleness", "buffer_groups (0 = two steps' worth)"}  # fmt: skip
    interval = next(n for n in at.number_input if n.label == "update_weights_interval")
    interval.set_value(2)
    at.button[0].click().run()  # the form's "Review change"
    assert any("update_weights_interval**: 1 → 2" in w.value for w in at.warning)
    assert dashboard_api["store"].schedule_changes(dashboard_api["running"]) == []  # not before confirming
    at.button(key="confirm").click().run()
    assert any("queued" in s.value for s in at.success), [e.value for e in at.error]
    assert not any("Apply" in w.value for w in at.warning)  # the confirmation cleared once submitted
    [change] = dashboard_api["store"].schedule_changes(dashboard_api["running"])
    assert change.patch == {"update_weights_interval": 2} and change.status == "pending"


def test_tune_disables_what_does_nothing_and_keeps_finished_history(app, dashboard_api):
    store = dashboard_api["store"]
    sync_job = seed_run(store, "sync-live", "sync", 50, JobStatus.RUNNING)
    try:
        at = app.run()
        at.switch_page("views/tune.py")
        at.session_state["job_id"] = sync_job
        at.run()
        assert not at.exception
        [mode] = [b for b in at.selectbox if b.label == "pause_mode"]
        assert mode.disabled and "generates nothing while weights are pushed" in texts(at)
    finally:
        store.set_status(sync_job, JobStatus.CANCELLED)
    at.session_state["job_id"] = dashboard_api["done"]
    at.toggle(key="tune_finished").set_value(True).run()
    assert not at.exception
    assert "This job has succeeded: its schedule can no longer change" in "\n".join(i.value for i in at.info)
    assert not [b for b in at.button if b.key == "confirm"]


def test_compare_page_puts_runs_side_by_side(app, dashboard_api):
    at = app.run()
    at.switch_page("views/compare.py").run()
    assert not at.exception
    at.multiselect(key="cmp").set_value([dashboard_api["done"], dashboard_api["running"]]).run()  # sync, fully_async
    [summary] = [d.value for d in at.dataframe if "run" in d.value.columns]
    assert sorted(summary["steps"].tolist()) == [5, 5] and summary["weight update ms (mean)"].tolist() == [50.0, 50.0]
    assert summary["achieved / ideal"].tolist() == [round(1.6 * 5 / 19.05, 2)] * 2  # rollout busy / wall
    assert summary["train % of wall"].tolist() == [round(100 * 1.4 * 5 / 19.05, 1)] * 2  # utilisation
    assert len(at.get("vega_lite_chart")) >= 2
    assert "No `miles bench schedules` report in this store yet" in texts(at)
    [diff] = [d.value for d in at.dataframe if "field" in d.value.columns]
    assert "schedule.type" in diff["field"].tolist() and not at.warning  # the schedule alone differs
    assert all(f.startswith("schedule.") for f in diff["field"])
    runs = f"cmp_metrics-{dashboard_api['done']}-{dashboard_api['running']}"
    at.multiselect(key=runs).set_value(["train/loss"]).run()
    at.radio(key="cmp_axis").set_value("step").run()
    assert not at.exception
    [chart] = [c for c in at.get("vega_lite_chart") if "train/loss" in str(c.proto.spec)]
    assert '"title": "step"' in chart.proto.spec
    # runs are named as their jobs are (the schedule has its own column)
    assert set(summary["run"]) == {f"#{dashboard_api['done']} sync-run", f"#{dashboard_api['running']} async-run"}
    # another choice of runs keeps the metric picked (it is on offer for them too)
    at.multiselect(key="cmp").set_value([dashboard_api["running"], dashboard_api["done"]]).run()
    again = f"cmp_metrics-{dashboard_api['running']}-{dashboard_api['done']}"
    assert at.multiselect(key=again).value == ["train/loss"]


def test_compare_warns_when_runs_differ_in_more_than_the_schedule(app, dashboard_api):
    store = dashboard_api["store"]
    other = seed_run(store, "bigger-batch", "sync", 5, JobStatus.SUCCEEDED, rollout={"num_prompts_per_step": 32})
    at = app.run()
    at.switch_page("views/compare.py").run()
    at.multiselect(key="cmp").set_value([dashboard_api["done"], other]).run()
    assert not at.exception
    [warning] = [w.value for w in at.warning]
    assert "differ in more than the schedule (rollout.num_prompts_per_step)" in warning


def test_reports_page_shows_a_bench_report_from_the_store(app, dashboard_api, tmp_path):
    """A report stored by a bench (its markdown and plots, with its runs), found through the API."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.plot([1, 2, 3], [0.2, 0.3, 0.5])
    plt.savefig(tmp_path / "reward_vs_step.png")
    plt.close()
    from miles_control.service.reports import save_report

    markdown = "# Schedule bench: quick\n\n## Throughput\n\n| schedule | steps |\n|---|---|\n| sync | 5 |\n\n"
    markdown += "A plot inline: ![reward against step](reward_vs_step.png) and after it.\n\nGenerated now.\n"
    (report_id,) = save_report("schedules", tmp_path, markdown, [dashboard_api["done"]], [dashboard_api["store"].url])
    at = app.run()
    at.switch_page("views/reports.py").run()
    assert not at.exception
    assert at.selectbox(key="report_id").value == report_id
    body = texts(at)
    assert "Schedule bench: quick" in body and "| sync | 5 |" in body and "Generated now." in body
    done = dashboard_api["done"]
    assert f"Its runs: [#{done}](job?job={done})" in body  # a link to the run's page
    assert "A plot inline:" in body and "and after it." in body  # the text around an inline image stays
    [image] = [e for e in at.main if type(e).__name__ == "Image"]  # the plot, served by the API
    assert "reward against step" in str(image.proto)
    at.segmented_control(key="report_kind").set_value("precision").run()
    assert "No bench report in this store yet" in "\n".join(i.value for i in at.info)
    at.switch_page("views/compare.py").run()
    assert f"#{report_id} Schedule bench: quick" in texts(at)


def test_every_visitor_signs_in_and_no_token_reaches_a_browser(dashboard_api, monkeypatch):
    """A MILES_TOKEN in the dashboard's environment is not used, nor shown: a visitor signs in with their own."""
    monkeypatch.setenv("MILES_API_URL", dashboard_api["url"])
    monkeypatch.setenv("MILES_TOKEN", dashboard_api["token"])
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not at.exception
    assert any("Sign in with your token" in i.value for i in at.info)
    token_field = next(t for t in at.text_input if t.label == "Token")
    assert token_field.value == "" and at.session_state["token"] == ""
    token_field.input("miles_not-a-token")
    next(b for b in at.button if b.label == "Connect").click().run()
    assert at.session_state["token"] == "" and any("Cannot use the Miles API" in e.value for e in at.error)
    token_field = next(t for t in at.text_input if t.label == "Token")  # the form stays, saying why
    token_field.input(dashboard_api["token"])
    next(b for b in at.button if b.label == "Connect").click().run()
    assert not at.info and at.session_state["token"] == dashboard_api["token"]  # signed in


def test_miles_dashboard_passes_no_token_and_stops_on_sigterm(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from miles_control.testing.servers import free_port, wait_until_serving

    port = free_port()
    env = {**os.environ, "MILES_TOKEN": "miles_secret_of_the_process"}
    cmd = [sys.executable, "-m", "miles_control.cli.main", "dashboard", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_until_serving(f"http://127.0.0.1:{port}/_stcore/health", proc)
        served_by = open(f"/proc/{proc.pid}/environ", "rb").read()  # the process serving the port is this one
        assert b"MILES_TOKEN" not in served_by and b"miles_secret_of_the_process" not in served_by
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
