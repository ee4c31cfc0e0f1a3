"""Schedules: how generation, training and weight pushes are ordered in time."""

from miles_control.job.schedules.fully_async import run_fully_async
from miles_control.job.schedules.one_step_off import run_one_step_off
from miles_control.job.schedules.sync import run_sync

SCHEDULES = {"sync": run_sync, "one_step_off": run_one_step_off, "fully_async": run_fully_async}

__all__ = ["SCHEDULES", "run_fully_async", "run_one_step_off", "run_sync"]
