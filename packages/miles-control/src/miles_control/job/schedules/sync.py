"""`sync`: generate(v) → train → push weights → generate(v+1). Strictly on-policy."""

from __future__ import annotations

import time

from miles_control.job.runtime.job import JobRuntime
from miles_control.job.schedules.common import StepCallback, should_stop
from miles_control.job.schedules.control import LiveSchedule
from miles_control.spec.config import SyncSchedule


def run_sync(
    rt: JobRuntime, schedule: SyncSchedule, eval_every: int, on_step: StepCallback, first_step: int = 1
) -> int:
    """Run the loop from `first_step` (after a resume: the step after the checkpoint); returns the last step."""
    started = time.time()
    live = LiveSchedule(schedule, rt.recorder)
    if first_step == 1:
        rt.recorder.metrics(0, rt.evaluate(step=0))
    step = first_step - 1
    for step in range(first_step, schedule.num_steps + 1):
        live.apply_pending(step)
        step_start = time.time()
        batch, metrics = rt.generate(step)
        metrics |= rt.train(step, batch)
        metrics |= rt.push_weights(step, pause_mode=live.config.pause_mode)
        if (eval_every and step % eval_every == 0) or step == schedule.num_steps:
            metrics |= rt.evaluate(step)
        metrics["step/wall_s"] = time.time() - step_start
        rt.recorder.step(step, rt.weight_version, step_start, time.time())
        rt.recorder.metrics(step, metrics)
        rt.checkpoint_if_due(step)
        on_step(step, metrics)
        if should_stop(schedule, metrics, started):
            if "eval/accuracy" not in metrics:
                rt.recorder.metrics(step, rt.evaluate(step))
            break
    return step
