"""Schedules: how generation, training and weight pushes are ordered in time."""

from miles_control.schedules.sync import run_sync

SCHEDULES = {"sync": run_sync}

__all__ = ["SCHEDULES", "run_sync"]
