"""Which CPU cores each stage runs on (`ray.cpu_split`): none idle by design.

Under `sync` the stages take turns, so each gets every core while the other waits. Under the overlapped schedules
(one_step_off, fully_async) they run at once on disjoint cores: halves at first, then, after `COST_STEPS` steps,
shares that make both stages take as long, from the busy time each measured on the cores it had."""

from __future__ import annotations

import os

from miles_control.spec.config import JobSpec

COST_STEPS = 3  # steps measured before the split follows the stages' costs (the first one warms caches up)


def cpu_plan(spec: JobSpec) -> dict[str, list[int] | None]:
    """The cores of the trainer ranks and of the rollout actor (None: not pinned, every core). No core is idle by
    design: `ray.cpu_split` splits the machine only where the stages run at the same time (the overlapped
    schedules), in halves until the stages' costs are measured (`JobRuntime.follow_stage_costs`); where they take
    turns (sync) each stage gets every core while the other waits."""
    if spec.ray.cpu_split and spec.schedule.overlaps_stages:
        return dict(split_cpus())
    return {"trainer": None, "rollout": None}


def split_cpus(trainer_share: float = 0.5, cores: list[int] | None = None) -> dict[str, list[int]]:
    """Disjoint cores of this machine (or `cores`): the trainer the first `trainer_share` of them, rounded, the
    rollout the rest, at least one each."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if len(cores) < 2:
        raise ValueError(f"ray.cpu_split needs at least 2 CPU cores; this process may use {cores}")
    first = min(len(cores) - 1, max(1, round(len(cores) * trainer_share)))
    return {"trainer": cores[:first], "rollout": cores[first:]}


def trainer_share(train_s: float, train_cores: int, rollout_s: float, rollout_cores: int) -> float:
    """The trainer's share of the cores that makes both stages take as long, from what each measured on the cores
    it had (its work: seconds × cores, assuming it scales with cores)."""
    train_work, rollout_work = train_s * train_cores, rollout_s * rollout_cores
    return train_work / (train_work + rollout_work) if train_work + rollout_work > 0 else 0.5
