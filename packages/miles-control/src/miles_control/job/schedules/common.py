"""What every schedule shares: stopping rules and evaluation that runs beside training."""

from __future__ import annotations

import time
from collections.abc import Callable

from miles_control.job.runtime.job import JobRuntime
from miles_control.spec.config import OverlappedSchedule, ScheduleBase

StepCallback = Callable[[int, dict[str, float]], None]


def should_stop(schedule: ScheduleBase, metrics: dict[str, float], started: float) -> bool:
    if schedule.stop_at_accuracy is not None and metrics.get("eval/accuracy", 0.0) >= schedule.stop_at_accuracy:
        return True
    return schedule.max_minutes is not None and time.time() - started > schedule.max_minutes * 60


class BackgroundEval:
    """At most one evaluation in flight on the rollout actor; its result is recorded at the step it started."""

    def __init__(self, rt: JobRuntime) -> None:
        self.rt = rt
        self._ref = None
        self._step = 0
        self.latest: dict[str, float] = {}

    def start(self, step: int) -> None:
        if self._ref is None:
            self._ref, self._step = self.rt.evaluate_async(), step

    def poll(self, wait: bool = False) -> dict[str, float]:
        """Record a finished evaluation (waiting for it when `wait`); returns its metrics or {}."""
        if self._ref is None:
            return {}
        result = self.rt.eval_result(self._ref, wait)
        if result is None:
            return {}
        metrics = self.rt.record_eval(self._step, result)
        self.rt.recorder.metrics(self._step, metrics)
        self._ref, self.latest = None, metrics
        return metrics


def finish_step(
    rt: JobRuntime,
    evals: BackgroundEval,
    cfg: OverlappedSchedule,
    step: int,
    version: int,
    last: bool,
    eval_every: int,
    step_start: float,
    metrics: dict[str, float],
    on_step: StepCallback,
) -> None:
    """After a train step of an asynchronous schedule: push if due, evaluate beside training, record.

    With `push_between_batches` the push lands once the batch being generated ends; the trainer checks and records
    it later (at the next push, or here at the last step). A batch or an evaluation asked for meanwhile waits on the
    rollout actor for the pushed version."""
    if version % cfg.update_weights_interval == 0 or last:
        metrics |= rt.push_weights(step, version, cfg.pause_mode, cfg.push_between_batches)
        if last:
            metrics |= rt.settle_push(record=False)
    if (eval_every and step % eval_every == 0) or last:
        evals.start(step)
    evaluated = evals.poll(wait=last or not cfg.async_eval)  # recorded at the step it started
    metrics["step/wall_s"] = time.time() - step_start
    rt.recorder.step(step, rt.weight_version, step_start, time.time())
    rt.recorder.metrics(step, metrics)
    rt.checkpoint_if_due(step)
    rt.follow_stage_costs(step)
    on_step(step, {**metrics, **evaluated})
