"""Issue 39 end to end: a job on a Parquet dataset (`data.source: hf`) and a model named by its Hub id
(`model.source: hub`, read offline from a prepared Hugging Face cache), with all three experiment trackers. It runs,
is interrupted after step 3, and resumes from the checkpoint of step 2: the resumed step draws the prompts the
stream would have drawn (the cursor continues), and every metric the store got is in each tracker with its step."""

import os
import socket
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_control.job.assets import resolve_model_path
from miles_control.job.data import load_job_prompts
from miles_control.job.run import run_job
from miles_control.service.store import JobStatus, Store
from miles_control.spec.load import parse_spec
from miles_control.testing.servers import put_in_hub_cache
from miles_rollout.data import PromptStream
from miles_rollout.tasks.arithmetic import arithmetic_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "miles-control" / "tests"))
from test_tracking import wandb_history  # noqa: E402

pytestmark = pytest.mark.slow
PER_STEP = 8


def test_parquet_and_a_hub_model_run_resume_and_reach_every_tracker(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    builtin = resolve_model_path(parse_spec({"name": "builtin"}))  # the demo's cached model, as if downloaded
    put_in_hub_cache(cache, "miles-test/tiny-arithmetic", builtin)
    rows = [{"question": r.prompt, "answer": r.label} for r in arithmetic_prompts(400, seed=3)]
    pq.write_table(pa.Table.from_pylist(rows[:200]), tmp_path / "train-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[200:]), tmp_path / "train-1.parquet")
    url = f"sqlite:///{tmp_path}/miles.db"
    spec = parse_spec({
        "name": "byo",
        "model": {"source": "hub", "name": "miles-test/tiny-arithmetic"},
        "data": {"source": "hf", "path": str(tmp_path / "train-*.parquet"), "prompt_key": "question",
                 "label_key": "answer", "eval_fraction": 0.1},
        "rollout": {"engine": {"type": "hf"}, "num_prompts_per_step": PER_STEP, "num_samples_per_prompt": 4,
                    "sampling": {"max_new_tokens": 6}, "eval": {"every_steps": 2, "num_prompts": 20}},
        "schedule": {"type": "sync", "num_steps": 3, "checkpoint_every": 2},
        "store": {"url": url, "samples_per_step": 8},
        "ray": {"num_cpus": 2},
        "output_dir": str(tmp_path / "runs"),
        "tracking": [{"type": "wandb", "mode": "offline"}, "tensorboard", "mlflow"],
    })  # fmt: skip

    def stop_after_3(step, metrics):
        if step == 3:
            raise KeyboardInterrupt  # as Ctrl-C after step 3: the checkpoint of step 2 is the newest

    with pytest.raises(KeyboardInterrupt):
        run_job(spec, on_step=stop_after_3, store=Store(url))
    store = Store(url)
    job = store.job(1)
    assert job.status == "cancelled" and [c.step for c in store.checkpoints(1)] == [2]
    events = store.events(1)
    assert [e.message for e in events if e.kind == "model"] == [f"model folder {cache}/models--miles-test--"
        f"tiny-arithmetic/snapshots/{os.listdir(cache / 'models--miles-test--tiny-arithmetic' / 'snapshots')[0]}"]  # fmt: skip
    assert sorted(e.data["type"] for e in events if e.kind == "tracking") == ["mlflow", "tensorboard", "wandb"]
    assert not [e for e in events if e.kind == "tracking" and e.data.get("level") == "warning"]

    # Every metric the store holds is in each tracker with its step; each span's duration too.
    stored = {(m.name, m.step, m.value) for m in store.metrics(1)}
    names = {name for name, _, _ in stored}
    assert {"eval/accuracy", "train/loss"} <= names and any("reward" in n for n in names)
    assert {s for _, s, _ in stored} == {0, 1, 2, 3}
    spans = sorted((f"time/{s.stage}_s", s.step, round(s.end - s.start, 6)) for s in store.spans(1))
    tracked = tmp_path / "runs" / "tracking"
    history, run = wandb_history(tracked / "wandb")
    points = [(k, row["step"], v) for row in history for k, v in row.items() if k != "step"]
    assert {p for p in points if not p[0].startswith("time/")} == stored
    assert sorted((k, s, round(v, 6)) for k, s, v in points if k.startswith("time/")) == spans
    assert run["name"] == "byo-job1" and run["config"]["data"]["source"] == "hf"
    board = EventAccumulator(str(tracked / "tensorboard" / "miles" / "byo-job1"))
    board.Reload()
    scalars = {(t, e.step, e.value) for t in board.Tags()["scalars"] for e in board.Scalars(t)}
    as_float32 = {(n, s, float(np.float32(v))) for n, s, v in stored}  # what TensorBoard keeps
    assert {p for p in scalars if not p[0].startswith("time/")} == as_float32
    assert {p[0] for p in scalars} >= {"time/train_s", "time/weight_sync_s", "time/rollout_s", "time/eval_s"}
    client = MlflowClient(tracking_uri=f"sqlite:///{tracked / 'mlflow' / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("miles").experiment_id])
    logged = {(m.key, m.step, m.value) for n in names for m in client.get_metric_history(found.info.run_id, n)}
    assert logged == stored

    # Resume from the checkpoint of step 2: step 3 is redone on the prompts the stream gives a third step.
    store.resume(1)
    store.set_status(1, JobStatus.STARTING)
    attempt = store.start_attempt(1, "inline", driver_pid=os.getpid(), driver_host=socket.gethostname())
    assert attempt.resume_step == 2
    run_job(spec.model_copy(update={"tracking": []}), store=store, job_id=1, attempt_id=attempt.id)
    job = store.job(1)
    assert job.status == "succeeded" and [s.step for s in store.steps(1)] == [1, 2, 3]
    train, _ = load_job_prompts(spec.data)
    stream = PromptStream(train, seed=spec.seed)
    first_two = {r.prompt for r in stream.next_batch(2 * PER_STEP)}
    third = {r.prompt for r in stream.next_batch(PER_STEP)}
    redone = {s.prompt for s in store.samples(1, step=3, limit=100)}
    assert redone and redone <= third and not redone & first_two, (redone, third)
    store.engine.dispose()
