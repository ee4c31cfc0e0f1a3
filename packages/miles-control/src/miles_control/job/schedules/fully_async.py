"""`fully_async`: rollout generates continuously into a bounded buffer; the trainer never waits for a step.

The rollout actor keeps `buffer_groups` finished groups ready (a group: all samples of one prompt,
tagged with every weight version its samples spanned). Each step the trainer takes
`num_prompts_per_step` groups whose staleness (trainer version − oldest version) is at most
`max_staleness`; older ones are dropped or regenerated (`stale_policy`) and counted. Weights are
pushed every `update_weights_interval` steps while generation goes on: with `push_between_batches` (the
default) a push waits for the stream's call under way to end (half a step's prompts) while the trainer
goes on, and the next call runs on the new weights; without it the push lands at once and in-flight
requests follow `pause_mode`. Evaluation runs beside training.
"""

from __future__ import annotations

import time

from miles_control.job.runtime.job import JobRuntime
from miles_control.job.schedules.common import BackgroundEval, StepCallback, finish_step, should_stop
from miles_control.job.schedules.control import LiveSchedule
from miles_control.spec.config import FullyAsyncSchedule


def buffer_capacity(schedule: FullyAsyncSchedule, groups_per_step: int) -> int:
    return schedule.buffer_groups or 2 * groups_per_step


def run_fully_async(
    rt: JobRuntime, schedule: FullyAsyncSchedule, eval_every: int, on_step: StepCallback, first_step: int = 1
) -> int:
    started = time.time()
    groups_per_step = rt.spec.rollout.num_prompts_per_step
    live = LiveSchedule(schedule, rt.recorder)
    evals = BackgroundEval(rt)
    if first_step == 1:
        evals.start(0)
        evals.poll(wait=True)
    capacity = buffer_capacity(schedule, groups_per_step)
    # Calls of half a step's prompts: small enough that the buffer fills steadily and pushes interleave.
    rt.start_stream(capacity, max(1, groups_per_step // 2))
    version = first_step - 1
    step = first_step - 1
    try:
        for step in range(first_step, schedule.num_steps + 1):
            for patch in live.apply_pending(step):
                if "buffer_groups" in patch:
                    rt.resize_buffer(buffer_capacity(live.config, groups_per_step))
            cfg = live.config
            step_start = time.time()
            batch, staleness, metrics = rt.take(step, groups_per_step, version, cfg.max_staleness, cfg.stale_policy)
            metrics |= rt.train(step, batch, staleness)
            version += 1
            last = step == schedule.num_steps
            finish_step(rt, evals, cfg, step, version, last, eval_every, step_start, metrics, on_step)
            if should_stop(schedule, {**evals.latest, **metrics}, started):
                break
        rt.settle_push()  # stopped early: the push of the last step done
        evals.poll(wait=True)
    finally:
        rt.stop_stream()
    return step
