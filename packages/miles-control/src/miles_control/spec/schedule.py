"""The schedules' settings (`schedule:` of the job spec): one model per schedule type, and which fields a running
job takes. Imports only pydantic (and the rollout's config), as `miles_control.spec.config` does."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from miles_rollout.config import PauseMode
from miles_sync.config import SpecModel


class _Strict(SpecModel):
    """A section of the job spec: unknown fields, inf/NaN and booleans for numbers are refused (miles_sync.config)."""


ScheduleType = Literal["sync", "one_step_off", "fully_async"]


class ScheduleBase(_Strict):
    """Fields every schedule has. The fields marked *live* can be changed while a job runs; a change applies at
    the next step boundary and is recorded as an event."""

    type: ScheduleType
    pause_mode: PauseMode = Field("in_place", description="(live) What in-flight requests do during a weight push.")
    num_steps: int = Field(300, gt=0)
    max_minutes: float | None = Field(None, gt=0, description="Stop after this much wall time (after a whole step).")
    stop_at_accuracy: float | None = Field(
        None, gt=0, le=1, description="Stop once held-out accuracy reaches this value."
    )
    save_final: bool = Field(False, description="Save a trainer checkpoint at the end of the run.")
    checkpoint_every: int = Field(
        0, ge=0, description="Save a trainer checkpoint every N steps (0 = never); a resumed job starts after the last."
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="Checkpoints kept on disk, the newest; an older one is deleted when a new one is saved."
    )
    max_restarts: int = Field(
        0,
        ge=0,
        le=100,
        description="When a worker process dies (a trainer rank or the rollout actor: killed, crashed, out of "
        "memory), restart the job's workers from the newest checkpoint up to this many times before failing.",
    )

    @model_validator(mode="before")
    @classmethod
    def _stored_defaults(cls, data: Any) -> Any:
        """Jobs stored before the schedule types were split carry every type's fields at their defaults: a field
        another type owns is dropped when it holds that default, and refused by name otherwise."""
        if isinstance(data, dict):
            data = {
                k: v
                for k, v in data.items()
                if k in cls.model_fields or k not in _OTHER_DEFAULTS or _OTHER_DEFAULTS[k] != v
            }  # a name no schedule type has is kept, and refused as unknown
        return data

    @classmethod
    def live_fields(cls) -> tuple[str, ...]:
        """The fields of this schedule type that a running job takes (`PATCH /jobs/{id}/schedule`)."""
        return tuple(name for name in LIVE_SCHEDULE_FIELDS if name in cls.model_fields)

    @property
    def push_every(self) -> int:
        """Push weights every this many train steps."""
        return 1

    @property
    def overlaps_stages(self) -> bool:
        """Whether generation and training run at the same time (then `ray.cpu_split` gives each its own cores);
        under a schedule whose stages take turns each stage uses every core."""
        return False


class SyncSchedule(ScheduleBase):
    """`sync`: generate → train → push, strictly on-policy."""

    type: Literal["sync"] = "sync"


class OverlappedSchedule(ScheduleBase):
    """Fields of the schedules where generation overlaps training."""

    update_weights_interval: int = Field(1, ge=1, description="(live) Push weights every N train steps.")
    push_between_batches: bool = Field(
        True,
        description="(live) A push waits for the batch being generated to end (one_step_off: the next step's batch; "
        "fully_async: the stream's call under way) and the next batch starts on the new weights, so the engines load "
        "with nothing in flight and the trainer goes on meanwhile. False: the push lands at once, and in-flight "
        "requests follow pause_mode.",
    )
    async_eval: bool = Field(True, description="Evaluate without blocking training.")

    @property
    def push_every(self) -> int:
        return self.update_weights_interval

    @property
    def overlaps_stages(self) -> bool:
        return True


class OneStepOffSchedule(OverlappedSchedule):
    """`one_step_off`: generation of step k+1 runs while step k trains, on weights one version old."""

    type: Literal["one_step_off"] = "one_step_off"


class FullyAsyncSchedule(OverlappedSchedule):
    """`fully_async`: rollout generates continuously into a bounded buffer; the trainer takes groups at most
    `max_staleness` versions old."""

    type: Literal["fully_async"] = "fully_async"
    max_staleness: int = Field(1, ge=0, description="(live) The oldest data the trainer takes, in weight versions.")
    stale_policy: Literal["drop", "regenerate"] = Field(
        "drop", description="What happens to a group that became too stale in the buffer."
    )
    buffer_groups: int | None = Field(
        None, ge=1, description="(live) Buffer capacity in groups; None = 2 steps' worth."
    )

    @model_validator(mode="after")
    def _staleness_reachable(self) -> FullyAsyncSchedule:
        if self.max_staleness < self.update_weights_interval - 1:
            raise ValueError(
                f"max_staleness {self.max_staleness} < update_weights_interval - 1 = "
                f"{self.update_weights_interval - 1}: between pushes even fresh samples would be too stale"
            )
        return self


ScheduleConfig = Annotated[SyncSchedule | OneStepOffSchedule | FullyAsyncSchedule, Field(discriminator="type")]
"""How generation, training and weight pushes are ordered in time: one model per `type` (default sync)."""
SCHEDULES: dict[str, type[ScheduleBase]] = {
    "sync": SyncSchedule,
    "one_step_off": OneStepOffSchedule,
    "fully_async": FullyAsyncSchedule,
}
LIVE_SCHEDULE_FIELDS = (
    "update_weights_interval",
    "max_staleness",
    "pause_mode",
    "buffer_groups",
    "push_between_batches",
)
_OTHER_DEFAULTS = {
    name: field.default
    for name, field in FullyAsyncSchedule.model_fields.items()
    if name not in ScheduleBase.model_fields
}


def schedule_config(data: dict[str, Any]) -> ScheduleConfig:
    """A validated schedule from a mapping (`type` defaults to sync)."""
    model = SCHEDULES.get(data.get("type", "sync"))
    if model is None:
        raise ValueError(f"schedule.type must be one of {', '.join(SCHEDULES)}, not {data.get('type')!r}")
    return model.model_validate(data)  # type: ignore[return-value]


def as_schedule(schedule: ScheduleConfig, type_: str) -> ScheduleConfig:
    """`schedule` as another type: the fields both types have keep their values, the others take defaults
    (how `miles bench schedules` runs one workload under every schedule)."""
    model = SCHEDULES[type_]
    kept = {k: v for k, v in schedule.model_dump().items() if k in model.model_fields and k != "type"}
    return model.model_validate({**kept, "type": type_})  # type: ignore[return-value]
