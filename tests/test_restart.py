"""`schedule.max_restarts`: a trainer rank killed with -9 mid-run; the job restarts its workers from the
newest checkpoint by itself, records the restart, and ends with each step recorded once."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_control.service.store import Store

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def trainer_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "^ray::TrainerWorker"], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def test_a_killed_trainer_rank_restarts_from_the_checkpoint(tmp_path):
    url = f"sqlite:///{tmp_path}/miles.db"
    overrides = [
        f"store.url={url}", f"output_dir={tmp_path}/runs", "rollout.engine.type=hf",
        "rollout.num_prompts_per_step=8", "rollout.eval.num_prompts=20", "rollout.eval.every_steps=2",
        "schedule.num_steps=6", "schedule.checkpoint_every=2", "schedule.max_restarts=1",
        "schedule.stop_at_accuracy=null", "schedule.max_minutes=null",
    ]  # fmt: skip
    args = [
        sys.executable,
        "-m",
        "miles_control.cli.main",
        "run",
        str(ROOT / "examples" / "arithmetic.yaml"),
        "--quiet",
    ]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        store = None
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:  # past the checkpoint of step 2, before the end
            if store is None and Path(f"{tmp_path}/miles.db").exists():
                store = Store(url)
            if store is not None and store.jobs()[1] and (store.last_step(1) or 0) >= 3:
                break
            time.sleep(0.2)
        pids = trainer_pids()
        assert pids and proc.poll() is None, "the job ended before a trainer rank could be killed"
        killed_after = store.last_step(1)
        subprocess.run(["kill", "-9", str(pids[0])], check=True)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    job = store.job(1)
    assert job.status == "succeeded", job.error
    assert [s.step for s in store.steps(1)] == [1, 2, 3, 4, 5, 6]  # each step once
    accuracy = store.metric_series(1, "eval/accuracy")
    assert [step for step, _ in accuracy] == sorted({step for step, _ in accuracy})  # no step twice
    [restart] = [e for e in store.events(1) if e.kind == "restart"]
    assert "restart 1 of 1 from the checkpoint of step" in restart.message, restart.message
    assert 2 <= restart.step <= killed_after  # the newest checkpoint before the kill
    assert [s.attrs["weight_version"] for s in store.spans(1, "weight_sync") if s.step > restart.step] == list(
        range(restart.step + 1, 7)
    )
