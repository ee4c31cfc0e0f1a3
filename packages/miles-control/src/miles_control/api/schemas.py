"""Request and response bodies of the REST API (per resource: Create / Update / Public)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles_control.config import JobSpec


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


def unstorable_text(value: Any, where: str = "spec") -> str | None:
    """The first string under `value` that no database can store (NUL, lone surrogates), by its path."""
    if isinstance(value, str):
        if "\x00" in value:
            return f"{where}: NUL characters are not allowed"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where}: not valid Unicode text (lone surrogate)"
    elif isinstance(value, dict):
        for key, item in value.items():
            problem = unstorable_text(key, f"{where} (a key)") or unstorable_text(item, f"{where}.{key}")
            if problem:
                return problem
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if problem := unstorable_text(item, f"{where}.{i}"):
                return problem
    return None


class JobCreate(_In):
    spec: JobSpec = Field(description="The job spec, as in a YAML file for `miles run` (without `store`).")

    @field_validator("spec", mode="before")
    @classmethod
    def _storable(cls, value: Any) -> Any:
        if problem := unstorable_text(value):
            raise ValueError(problem)
        return value


class SchedulePatch(_In):
    """Live schedule fields; applied by the running job at its next step boundary, and recorded."""

    update_weights_interval: int | None = Field(None, ge=1, le=1_000_000)
    max_staleness: int | None = Field(None, ge=0, le=1_000_000)
    pause_mode: Literal["in_place", "retract", "abort"] | None = None
    buffer_groups: int | None = Field(None, ge=1, le=1_000_000)


class JobPublic(_Out):
    id: int
    name: str
    status: str
    error: str | None
    source: str
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime | None
    schedule: str = Field(description="The schedule type: sync, one_step_off or fully_async.")
    last_step: int | None = Field(description="The newest completed step.")
    num_steps: int
    resumable: bool = Field(description="failed or cancelled: `resume` queues it again.")


class AttemptPublic(_Out):
    id: int
    number: int
    launcher: str
    resume_step: int
    status: str
    exit_reason: str | None
    driver_pid: int | None
    driver_host: str | None
    submission_id: str | None
    started_at: datetime
    ended_at: datetime | None


class CheckpointPublic(_Out):
    step: int
    weight_version: int
    path: str
    created_at: datetime


class JobDetail(JobPublic):
    spec: dict[str, Any]
    attempts: list[AttemptPublic]
    checkpoints: list[CheckpointPublic]


class JobPage(BaseModel):
    items: list[JobPublic]
    total: int
    limit: int
    offset: int


class MetricPoint(_Out):
    name: str
    step: int
    value: float
    wall_time: float


class SpanPublic(_Out):
    step: int
    stage: str
    worker: str
    start: float
    end: float
    num_tokens: int
    num_bytes: int
    attrs: dict[str, Any]


class StepPublic(_Out):
    step: int
    weight_version: int
    started_at: float
    ended_at: float


class EventPublic(_Out):
    id: int
    step: int | None
    kind: str
    message: str
    data: dict[str, Any]
    created_at: datetime


class SamplePublic(_Out):
    step: int
    prompt: str
    response: str
    label: str | None
    reward: float
    status: str
    weight_versions: list[int]


class ScheduleChangePublic(_Out):
    id: int
    patch: dict[str, Any]
    status: str
    message: str
    applied_step: int | None
    requested_at: datetime


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    store: str
    launcher: str
    launcher_error: str | None
    version: str
