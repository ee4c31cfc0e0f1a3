"""`one_step_off`: the batch of step k+1 is generated while step k trains.

Step k trains on data generated under the weights of step k−1 or older (staleness ≤ interval).
Weights are pushed every `update_weights_interval` steps; a push that lands while the next batch is
being generated handles its in-flight requests by `pause_mode`, and those samples record every
version they span.
"""

from __future__ import annotations

import time

from miles_control.config import OneStepOffSchedule
from miles_control.convert import staleness_metrics
from miles_control.runtime.job import JobRuntime
from miles_control.schedules.common import BackgroundEval, StepCallback, finish_step, should_stop
from miles_control.schedules.control import LiveSchedule


def run_one_step_off(
    rt: JobRuntime, schedule: OneStepOffSchedule, eval_every: int, on_step: StepCallback, first_step: int = 1
) -> int:
    started = time.time()
    live = LiveSchedule(schedule, rt.recorder)
    evals = BackgroundEval(rt)
    if first_step == 1:
        evals.start(0)
        evals.poll(wait=True)  # the starting point, before any training
    version = first_step - 1  # the trainer's version: train steps done
    pending = rt.generate_async()
    step = first_step - 1
    for step in range(first_step, schedule.num_steps + 1):
        live.apply_pending(step)
        cfg = live.config
        step_start = time.time()
        batch, metrics = rt.collect(step, pending)
        last = step == schedule.num_steps
        if not last:
            pending = rt.generate_async()  # the next batch, generated while this one trains
        staleness = [s.staleness(version) for s in batch.samples]
        metrics |= rt.train(step, batch, staleness)
        metrics |= staleness_metrics(staleness)
        version += 1
        finish_step(rt, evals, cfg, step, version, last, eval_every, step_start, metrics, on_step)
        if should_stop(schedule, {**evals.latest, **metrics}, started):
            break
    evals.poll(wait=True)
    return step
