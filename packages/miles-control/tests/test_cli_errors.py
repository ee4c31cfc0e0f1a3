"""Bad input through `miles run`: clear errors, non-zero exits, nothing built, nothing lost."""

import os
import subprocess
import sys
from pathlib import Path

from miles_control.service.store import JobStatus, Store

MILES = [sys.executable, "-m", "miles_control.cli.main"]


def miles_run(tmp_path: Path, spec_text: str, *extra: str) -> subprocess.CompletedProcess:
    spec = tmp_path / "job.yaml"
    spec.write_text(spec_text)
    env = {**os.environ, "MILES_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    return subprocess.run(
        [*MILES, "run", str(spec), "--quiet", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )


def test_invalid_spec_exits_2_naming_fields_before_anything_loads(tmp_path):
    result = miles_run(
        tmp_path,
        f"name: bad\nstore:\n  url: sqlite:///{tmp_path}/m.db\n",
        "--set",
        "rollout.sampling.top_p=1.5",
        "--set",
        "train.algorithm.clip=0.1",
    )
    assert result.returncode == 2, result.stderr
    assert "rollout.sampling.top_p: Input should be less than or equal to 1" in result.stderr
    assert "train.algorithm.clip: Extra inputs are not permitted" in result.stderr
    assert not (tmp_path / "cache").exists()  # no model was built
    assert not (tmp_path / "m.db").exists()  # no job was created


def test_malformed_prompt_file_fails_the_job_and_keeps_earlier_data(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    store = Store(url)
    earlier = store.create_job("earlier", {})
    store.add_metrics(earlier, 1, {"eval/accuracy": 0.5})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n' * 3 + '{"prompt": "2+2=" "label": "4"}\n')
    result = miles_run(
        tmp_path, f"name: bad-data\nstore:\n  url: {url}\ndata:\n  source: file\n  path: {prompts}\n  num_eval: 1\n"
    )
    assert result.returncode == 1
    assert f"{prompts}:4: invalid JSON" in result.stderr
    failed = store.job(earlier + 1)
    assert failed.status == "failed" and f"{prompts}:4" in failed.error
    assert store.metric_series(earlier, "eval/accuracy") == [(1, 0.5)]
    assert not (tmp_path / "cache").exists()


def test_missing_model_folder_is_named(tmp_path):
    result = miles_run(
        tmp_path,
        f"name: m\nstore:\n  url: sqlite:///{tmp_path}/m.db\nmodel:\n  source: path\n  path: {tmp_path}/nowhere\n",
    )
    assert result.returncode == 1
    assert f"model.path: {tmp_path}/nowhere is not an HF model folder" in result.stderr


def test_data_arithmetic_writes_loadable_jsonl(tmp_path):
    from miles_rollout.data import load_prompts

    out = tmp_path / "a.jsonl"
    args = [*MILES, "data", "arithmetic", str(out), "--num-prompts", "20", "--seed", "3", "--operations", "+*"]
    subprocess.run(args, check=True, capture_output=True)
    records = load_prompts(out)
    assert len(records) == 20 and all(r.prompt.endswith("=") for r in records)
    assert {r.prompt[2] for r in records} <= {"+", "*"}
    bad = subprocess.run([*MILES, "data", "arithmetic", str(out), "--operations", "/"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--operations" in bad.stderr


def test_schedule_set_queues_live_changes_and_refuses_others(tmp_path):
    url = f"sqlite:///{tmp_path}/m.db"
    store = Store(url)
    job = store.create_job("j", {"schedule": {"type": "one_step_off"}})

    def schedule_set(*args: str) -> subprocess.CompletedProcess:
        cmd = [*MILES, "schedule", "set", *args, "--store", url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})

    ok = schedule_set(str(job), "update_weights_interval=2", "pause_mode=retract")
    assert ok.returncode == 0, ok.stderr
    [change] = store.pending_schedule_changes(job)
    assert change.patch == {"update_weights_interval": 2, "pause_mode": "retract"}  # typed values

    bad = schedule_set(str(job), "max_staleness")
    assert bad.returncode == 2 and "'max_staleness': expected field=value" in bad.stderr
    # the API's own check (miles_control.job.schedules.control.queue_schedule_change): live fields only, ...
    bad = schedule_set(str(job), "num_steps=5")
    assert bad.returncode == 2 and "num_steps: not a live field of a one_step_off schedule" in bad.stderr
    # ... of the job's schedule type (a sync job has no staleness bound), ...
    sync = store.create_job("s", {})
    bad = schedule_set(str(sync), "max_staleness=2")
    assert bad.returncode == 2 and "max_staleness: not a live field of a sync schedule (live: pause_mode)" in bad.stderr
    # ... a schedule still valid once patched, ...
    fully_async = store.create_job("f", {"schedule": {"type": "fully_async", "update_weights_interval": 1}})
    bad = schedule_set(str(fully_async), "update_weights_interval=4")
    assert bad.returncode == 2 and "max_staleness 1 < update_weights_interval - 1 = 3" in bad.stderr, bad.stderr
    assert bad.stderr.count("error:") == 1
    # ... and an active job
    store.set_status(fully_async, JobStatus.CANCELLED)
    bad = schedule_set(str(fully_async), "max_staleness=3")
    assert bad.returncode == 2 and "is cancelled; only an active job's schedule can change" in bad.stderr
    missing = schedule_set("999", "max_staleness=2")
    assert missing.returncode == 2 and "no job 999" in missing.stderr
    assert len(store.pending_schedule_changes(job)) == 1  # nothing else was queued
    assert store.pending_schedule_changes(fully_async) == store.pending_schedule_changes(sync) == []


def test_first_run_mistakes_are_one_line_and_exit_2(tmp_path):
    """A folder, an empty path, a file that is not UTF-8, a store URL of no database: one line naming the
    problem (no traceback), exit 2."""
    (tmp_path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))

    def miles(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "COLUMNS": "300"}
        return subprocess.run([*MILES, *args], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)

    cases = [
        (("run", str(tmp_path)), "is a folder, not a job spec"),
        (("run", ""), "is a folder, not a job spec"),
        (("run", str(tmp_path / "latin1.yaml")), "line 1: not UTF-8 text (byte 9)"),
        (("serve", "--store", "nonsense://x"), "store nonsense://x: not a database URL Miles can open"),
        (("tokens", "list", "--store", "postgresql+psycopg://u:secretpw@127.0.0.1:1/x"),
         "store postgresql+psycopg://u:***@127.0.0.1:1/x: cannot open it"),
    ]  # fmt: skip
    for args, expected in cases:
        result = miles(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert expected in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
        assert "secretpw" not in result.stderr + result.stdout
