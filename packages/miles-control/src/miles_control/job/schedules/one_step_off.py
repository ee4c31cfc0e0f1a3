"""`one_step_off`: the batch of step k+1 is generated while step k trains.

Step k trains on data generated under the weights of step k−1 or older (staleness ≤ interval).
Weights are pushed every `update_weights_interval` steps. With `push_between_batches` (the default) a
push waits for the batch being generated to end and the batch after it runs on the new weights: the
engines load with nothing in flight, and every batch is generated under one version. Without it a push
lands while the next batch is being generated, its in-flight requests follow `pause_mode`, and those
samples record every version they span.
"""

from __future__ import annotations

import time

from miles_control.job.convert import staleness_metrics
from miles_control.job.runtime.job import JobRuntime
from miles_control.job.schedules.common import BackgroundEval, StepCallback, finish_step, should_stop
from miles_control.job.schedules.control import LiveSchedule
from miles_control.spec.config import OneStepOffSchedule


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
    ahead = None  # the batch of the step after next, asked for once this step's push was made
    step = first_step - 1
    for step in range(first_step, schedule.num_steps + 1):
        live.apply_pending(step)
        cfg = live.config
        step_start = time.time()
        batch, metrics = rt.collect(step, pending)
        last = step == schedule.num_steps
        # the next step's batch, generated while this one trains (asked for a step ahead unless this is the first)
        pending = ahead if ahead is not None or last else rt.generate_async()
        ahead = None
        staleness = [s.staleness(version) for s in batch.samples]
        metrics |= rt.train(step, batch, staleness)
        metrics |= staleness_metrics(staleness)
        version += 1
        finish_step(rt, evals, cfg, step, version, last, eval_every, step_start, metrics, on_step)
        if should_stop(schedule, {**evals.latest, **metrics}, started):
            break
        if step + 2 <= schedule.num_steps:
            # The batch of step + 2, asked for now: the rollout actor starts it when the batch of step + 1 ends and
            # the push just made has landed (between those batches, or already), with no round trip in between.
            ahead = rt.generate_async()
    rt.settle_push()  # stopped early: the push of the last step done
    evals.poll(wait=True)
    return step
