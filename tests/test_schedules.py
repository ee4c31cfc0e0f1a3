"""The schedules through `miles run`: overlap, the staleness bound, live changes, determinism of sync."""

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_control.service.store import Store
from miles_control.service.summary import summarize

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SMALL = ["rollout.num_prompts_per_step=16", "rollout.eval.num_prompts=50", "rollout.eval.every_steps=2"]


def command(tmp_path: Path, *overrides: str) -> tuple[list[str], str]:
    url = f"sqlite:///{tmp_path}/miles.db"
    args = [
        sys.executable,
        "-m",
        "miles_control.cli.main",
        "run",
        str(ROOT / "examples" / "arithmetic.yaml"),
        "--quiet",
    ]
    for o in (f"store.url={url}", f"output_dir={tmp_path}/runs", *SMALL, *overrides):
        args += ["--set", o]
    return args, url


def run(tmp_path: Path, *overrides: str) -> Store:
    tmp_path.mkdir(parents=True, exist_ok=True)
    args, url = command(tmp_path, *overrides)
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return Store(url)


def series(store: Store, name: str) -> dict[int, float]:
    return dict(store.metric_series(1, name))


@pytest.mark.extended  # two identical jobs: a repeat by nature (the default tier runs sync jobs in many tests)
def test_sync_is_deterministic_under_a_seed(tmp_path):
    runs = [run(tmp_path / str(i), "rollout.engine.type=hf", "schedule.num_steps=3") for i in range(2)]
    assert [r.job(1).status for r in runs] == ["succeeded", "succeeded"], [r.job(1).error for r in runs]
    # a value at each of the 3 steps; evaluations before training, at step 2 (every 2 steps) and at the last
    lengths = {"rollout/reward_mean": 3, "train/loss": 3, "train/grad_norm": 3, "eval/accuracy": 3}
    for name, length in lengths.items():
        first, second = series(runs[0], name), series(runs[1], name)
        assert len(first) == length, (name, first)  # something to compare: two empty series would agree
        assert first == second, name


def test_one_step_off_overlaps_and_stays_one_version_behind(tmp_path):
    store = run(
        tmp_path, "rollout.engine.type=hf", "schedule.type=one_step_off", "schedule.num_steps=5", "ray.cpu_split=true"
    )
    assert store.job(1).status == "succeeded", store.job(1).error
    # the cores: halves at first, then the shares the measured stage costs give (on 2 cores, one each still)
    splits = [e for e in store.events(1) if e.kind == "cpu_split"]
    assert len(splits) == 2, [e.message for e in splits]
    assert splits[0].message.startswith("trainer on cores"), splits[0].message
    assert re.match(r"(kept|after) .*3 steps \(train [0-9.]+ s on \d+ cores, rollout [0-9.]+ s", splits[1].message)
    staleness = series(store, "async/staleness_max")
    assert len(staleness) == 5, staleness  # a value per step
    assert staleness[1] == 0 and all(staleness[s] <= 1 for s in staleness), staleness
    assert max(staleness.values()) == 1  # step k trains on data generated before step k−1's weights
    rollouts = store.spans(1, "rollout")
    trains = store.spans(1, "train")
    overlap = sum(
        max(0.0, min(r.end, t.end) - max(r.start, t.start)) for r in rollouts for t in trains if r.step == t.step + 1
    )
    assert overlap > 0, "generation of step k+1 never ran while step k trained"
    syncs = store.spans(1, "weight_sync")
    assert len(syncs) == 5, syncs  # a push per step (update_weights_interval 1)
    assert all(s.attrs["trainer_fingerprint"] == s.attrs["engine_fingerprint"] for s in syncs)
    for s in syncs:  # where each push's time went; the hf engine has no servers to pause or check
        assert set(s.attrs["phases"]) == {"export", "handoff", "wait_batch", "pause", "load", "resume"}, s.attrs
        assert 0 < sum(s.attrs["phases"].values()) <= s.end - s.start + 0.01, (s.attrs["phases"], s.end - s.start)
    # push_between_batches (the default): each push waited for the batch under way to end, and the batch after it
    # started once the push had landed: nothing of a batch was in flight while the engine loaded
    by_step = {r.step: r for r in rollouts}
    for s in syncs[:-1]:
        waited_from, waited_to = s.attrs["waited"]
        assert by_step[s.step + 1].end <= waited_to + 0.05, (s.step, by_step[s.step + 1].end, waited_to)
        if s.step + 2 in by_step:  # the batch after the last step is not generated
            assert by_step[s.step + 2].start >= s.end - 0.05, (s.step, by_step[s.step + 2].start, s.end)
    # a deferred push's metrics are recorded at its own step
    assert series(store, "sync/weight_version") == {k: float(k) for k in range(1, 6)}


@pytest.mark.sglang
def test_fully_async_respects_max_staleness_and_takes_live_changes(tmp_path):
    pytest.importorskip("sglang", reason="SGLang is not installed")
    args, url = command(
        tmp_path,
        "rollout.engine.type=sglang",
        "schedule.type=fully_async",
        "schedule.num_steps=14",
        "schedule.update_weights_interval=1",
        "schedule.max_staleness=1",
    )
    job = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    store = Store(url)
    deadline = time.time() + 600
    while time.time() < deadline and job.poll() is None:
        try:
            if len(store.steps(1)) >= 3:
                break
        except Exception:  # noqa: BLE001 - the job has not created its tables yet
            pass
        time.sleep(0.5)
    assert job.poll() is None, job.stderr.read()[-3000:]
    store.request_schedule_change(1, {"update_weights_interval": 2, "max_staleness": 2, "pause_mode": "retract"})
    store.request_schedule_change(1, {"num_steps": 99})  # not a live field: rejected, recorded
    _, err = job.communicate(timeout=900)
    assert job.returncode == 0, err[-4000:]

    changes = store.schedule_changes(1)
    assert [c.status for c in changes] == ["applied", "rejected"]
    applied_at = changes[0].applied_step
    assert applied_at is not None and applied_at > 3
    assert "cannot change num_steps" in changes[1].message
    events = {e.kind: e for e in store.events(1)}
    assert events["schedule_change"].step == applied_at
    assert "update_weights_interval: 1 → 2" in events["schedule_change"].message

    staleness = series(store, "async/staleness_max")
    assert len(staleness) == 14, staleness  # a value per step
    assert all(v <= (1 if step < applied_at else 2) for step, v in staleness.items()), staleness
    pushes = {s.step: s.attrs["pause_mode"] for s in store.spans(1, "weight_sync")}
    before = [s for s in pushes if s < applied_at]
    after = [s for s in pushes if s >= applied_at and s != 14]
    assert before == list(range(1, applied_at))  # every step before the change
    assert all(s % 2 == 0 for s in after) and {pushes[s] for s in after} == {"retract"}
    assert store.job(1).status == "succeeded"

    # every push says where its time went: the phases cover its latency (up to the driver's bookkeeping)
    syncs = store.spans(1, "weight_sync")
    assert len(syncs) >= applied_at, syncs  # the pushes before the change and the last step's, at least
    for span in syncs:
        phases = span.attrs["phases"]
        assert {"export", "handoff", "wait_batch", "pause", "pause/probe_wait", "load", "load/verify", "resume"} <= set(
            phases
        )
        assert all(v >= -0.01 for v in phases.values()), phases
        assert phases["pause/probe_wait"] <= phases["pause"] + 1e-3 and phases["load/verify"] <= phases["load"] + 1e-3
        top = sum(v for k, v in phases.items() if "/" not in k)
        assert top <= span.end - span.start + 0.01 and top >= 0.8 * (span.end - span.start), (
            phases,
            span.end - span.start,
        )
    breakdown = summarize(store, 1).push_phases_s
    assert breakdown["load"] > 0 and "unaccounted" in breakdown, breakdown


def test_partial_rollouts_continue_what_a_push_aborts(tmp_path):
    """fully_async with a buffer that never fills pushes while the engine generates; with pause_mode abort and partial_rollouts the aborted
    requests are continued under the new weights (the trainer's weighting of their tokens by their own age is
    checked in packages/miles-train/tests/test_backend_contract.py, the join in test_engine_contract.py)."""
    store = run(
        tmp_path,
        "rollout.engine.type=hf",
        "schedule.type=fully_async",
        "schedule.num_steps=8",  # more pushes: under load a push can find no request in flight (6 once saw none)
        "schedule.pause_mode=abort",
        "schedule.push_between_batches=false",  # push into the requests in flight
        "schedule.max_staleness=2",
        "schedule.buffer_groups=1024",  # never full: the engine generates through every push
        "rollout.partial_rollouts=true",
        "train.grpo.staleness=decay",
    )
    assert store.job(1).status == "succeeded", store.job(1).error
    continued = series(store, "rollout/partial_continued")
    assert sum(continued.values()) > 0, continued  # some requests spanned a push and went on
    losses = series(store, "train/loss")
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses.values()), losses
    syncs = store.spans(1, "weight_sync")
    assert len(syncs) == 8, syncs  # a push per step (update_weights_interval 1)
    assert all(s.attrs["pause_mode"] == "abort" for s in syncs)
    assert all(s.attrs["trainer_fingerprint"] == s.attrs["engine_fingerprint"] for s in syncs)


def test_unchecked_pushes_and_unclipped_norms_are_reported_as_what_they_are(tmp_path):
    """Issue 55, item 5: with the weight check off, `sync/weights_match` read 1.0 although nothing was compared, and
    with `optimizer.max_grad_norm: null` (the demo's setting) `train/grad_norm` read 0.0. Now an unchecked push
    records no match value and the job says so once; the norm is measured either way."""
    overrides = ["sync.check_weights=false", "train.optimizer.max_grad_norm=null"]
    store = run(tmp_path, "rollout.engine.type=hf", "schedule.num_steps=2", *overrides)
    assert store.job(1).status == "succeeded", store.job(1).error
    assert series(store, "sync/weights_match") == {}
    assert len(series(store, "sync/weight_version")) == 2  # the pushes happened and were recorded
    said = [e.message for e in store.events(1) if e.kind == "weights_unchecked"]
    assert len(said) == 1 and "sync.check_weights is off" in said[0], said
    norms = series(store, "train/grad_norm")
    assert len(norms) == 2 and all(n > 0 for n in norms.values()), norms
