"""The run summary's weight-push breakdown, on spans written to a real store."""

import pytest

from miles_control.service.store import Store
from miles_control.service.summary import push_breakdown, summarize


def test_push_breakdown_averages_each_phase_and_names_what_the_phases_miss():
    pushes = [
        (0.30, {"export": 0.02, "pause": 0.10, "pause/probe_wait": 0.08, "load": 0.15, "resume": 0.01}),
        (0.10, {"export": 0.02, "pause": 0.01, "load": 0.05, "resume": 0.01, "check": 0.01}),
    ]
    mean = push_breakdown(pushes)
    assert mean["pause"] == pytest.approx(0.055) and mean["pause/probe_wait"] == pytest.approx(0.04)
    assert mean["check"] == pytest.approx(0.005)  # a phase one push lacks counts as 0 there
    # mean latency 0.2; the top-level phases cover 0.19 (the probe wait is inside the pause, not beside it)
    assert mean["unaccounted"] == pytest.approx(0.01)
    assert push_breakdown([]) == {}


def test_summary_reads_the_phases_of_each_weight_sync_span(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/miles.db")
    job = store.create_job("j", {"schedule": {"type": "one_step_off"}, "rollout": {}}, source="cli")
    for step in (1, 2):
        base = 100.0 + 10 * step
        store.add_spans(job, [
            dict(stage="train", step=step, worker="trainer", start=base, end=base + 1),
            dict(stage="weight_sync", step=step, worker="trainer->rollout-0", start=base + 1, end=base + 1.2,
                 attrs={"phases": {"export": 0.05, "handoff": 0.01, "pause": 0.04, "load": 0.08, "resume": 0.01}}),
        ])  # fmt: skip
        store.add_step(job, step, step, base, base + 1.2)
    summary = summarize(store, job)
    assert summary.push_phases_s["load"] == pytest.approx(0.08)
    assert summary.push_phases_s["unaccounted"] == pytest.approx(0.01)
    assert summary.to_dict()["push_phases_s"] == summary.push_phases_s  # what the API serves


def test_time_to_target_reads_the_first_wall_time_at_the_accuracy_every_schedule_reached():
    from miles_control.bench.schedules import time_to_target_table
    from miles_control.service.summary import RunSummary, time_to_accuracy

    def run(schedule: str, curve: list[tuple[float, float]]) -> RunSummary:
        return RunSummary(job_id=1, status="succeeded", schedule=schedule, num_steps=3, wall_s=60.0, samples=1,
                          tokens=1.0, accuracy_by_wall=curve)  # fmt: skip

    assert time_to_accuracy([(0.0, 0.4), (20.0, 0.5), (40.0, 0.6)], 0.5) == 20.0
    assert time_to_accuracy([(0.0, 0.4)], 0.5) is None
    sync = run("sync", [(0.0, 0.40), (30.0, 0.48), (60.0, 0.55)])
    fast = run("fully_async", [(0.0, 0.40), (20.0, 0.50), (45.0, 0.52)])
    table = "\n".join(time_to_target_table([sync, fast]))
    assert "held-out accuracy 0.520" in table  # the lower of the two best accuracies
    assert "| sync | 60.0 | 1.00 |" in table and "| fully_async | 45.0 | 0.75 |" in table
    # a target the first evaluation already held: no time to measure, said so (not "0.0 s"); the plot on its own line
    flat = run("one_step_off", [(0.0, 0.60), (30.0, 0.60)])
    table = "\n".join(time_to_target_table([flat, run("sync", [(0.0, 0.55), (30.0, 0.60)])]))
    assert "| one_step_off | at the first evaluation |" in table and "| sync | 30.0 |" in table
    assert "\n![accuracy against wall time](accuracy_vs_wall.png)\n" in table


def test_a_push_that_waited_for_the_batch_to_end_counts_without_the_wait(tmp_path):
    """schedule.push_between_batches: the wait is reported apart, and is neither the push's latency nor trainer
    busy time (the trainer trained meanwhile, or waited for that batch anyway)."""
    store = Store(f"sqlite:///{tmp_path}/miles.db")
    job = store.create_job("j", {"schedule": {"type": "fully_async"}, "rollout": {}}, source="cli")
    phases = {"export": 0.05, "handoff": 0.01, "wait_batch": 0.5, "pause": 0.01, "load": 0.02, "resume": 0.01}
    store.add_spans(job, [
        dict(stage="train", step=1, worker="trainer", start=100.0, end=101.0),
        # published 101.0–101.05, handed over at 101.06, waited to 101.56, landed at 101.6
        dict(stage="weight_sync", step=1, worker="trainer->rollout-0", start=101.0, end=101.6,
             attrs={"phases": phases, "waited": [101.06, 101.56]}),
        dict(stage="train", step=2, worker="trainer", start=101.06, end=102.0),
    ])  # fmt: skip
    store.add_step(job, 1, 1, 100.0, 101.06)
    store.add_step(job, 2, 2, 101.06, 102.0)
    summary = summarize(store, job)
    assert summary.weight_sync_s == [pytest.approx(0.1)] and summary.push_waits_s == [pytest.approx(0.5)]
    assert "wait_batch" not in summary.push_phases_s
    assert summary.push_phases_s["unaccounted"] == pytest.approx(0.0, abs=1e-9)
    assert summary.trainer_busy_s == pytest.approx(2.0)  # train 100–101 and 101.06–102, the push's 0.1 s beside


def test_the_rollouts_idle_time_between_batches_is_split_by_what_ran_meanwhile():
    from types import SimpleNamespace

    from miles_control.service.summary import rollout_gaps

    def span(stage, start, end, **attrs):
        return SimpleNamespace(stage=stage, start=start, end=end, attrs=attrs)

    spans = [
        span("rollout", 0.0, 1.0),
        span("train", 0.5, 1.6),  # the batch after waits 0.6 s for this step (one_step_off)
        span("weight_sync", 1.6, 1.7),
        span("train", 1.8, 2.5),  # the next step
        span("rollout", 1.8, 3.0),  # 0.1 s of round trips before it
        span("weight_sync", 3.0, 4.0, waited=[3.01, 3.9]),  # waited for the batch to end: not a push at work
        span("rollout", 3.2, 4.0),
    ]
    gaps = rollout_gaps(spans)
    assert gaps["idle"] == pytest.approx(1.0)  # 0.8 s + 0.2 s
    assert gaps["training"] == pytest.approx(0.6)
    assert gaps["pushing"] == pytest.approx(0.1 + 0.01)  # the push's own 0.1 s, and the second's hand-off
    assert gaps["other"] == pytest.approx(1.0 - 0.6 - 0.11)
    assert "drain" not in gaps
    spans += [span("train", 4.0, 4.7), span("weight_sync", 4.7, 4.8), span("eval", 4.8, 5.5)]
    drained = rollout_gaps(spans, loop_end=5.5)
    assert drained["drain"] == pytest.approx(0.8)  # the last training and push; the final evaluation is busy
    assert drained["idle"] == pytest.approx(gaps["idle"])
