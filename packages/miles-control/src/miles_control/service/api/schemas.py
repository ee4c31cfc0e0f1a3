"""Response bodies of the REST API (per resource: Public / Detail / Page), what the typed client returns.

Imports pydantic only, so the client and the dashboard install without the rest of Miles (no torch, no Ray). The
request bodies that embed the job spec live in `miles_control.service.api.requests`, on the server's side.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


UtcDatetime = Annotated[datetime, AfterValidator(_utc)]
"""A time as the API sends it: with its zone (the store writes UTC; SQLite gives it back without one)."""


class ErrorDetail(BaseModel):
    """The body of every error but 422: what went wrong, in words."""

    detail: str


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class JobPublic(_Out):
    id: int
    name: str
    status: str
    error: str | None
    source: str
    cancel_requested: bool
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    updated_at: UtcDatetime | None
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
    started_at: UtcDatetime
    ended_at: UtcDatetime | None


class CheckpointPublic(_Out):
    step: int
    weight_version: int
    path: str
    created_at: UtcDatetime


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


class StageSummaryPublic(BaseModel):
    stage: str
    count: int
    total_s: float
    share_of_wall: float = Field(
        description="Summed span time over the loop's wall time; overlapping stages add up to > 1."
    )
    num_tokens: int
    idle: bool = Field(description="Time a component spent waiting (wait_rollout), not working.")
    tokens_per_s: float | None


class RunSummaryPublic(BaseModel):
    """The summary `miles run` prints and `miles bench schedules` reports (miles_control.service.summary)."""

    job_id: int
    status: str
    schedule: str
    num_steps: int
    wall_s: float = Field(description="First step's start to last step's end.")
    samples: int
    tokens: float
    stages: list[StageSummaryPublic]
    rollout_busy_s: float
    trainer_busy_s: float
    weight_sync_s: list[float]
    push_phases_s: dict[str, float] = Field(
        default_factory=dict,
        description="Mean seconds per weight push in each phase (export, handoff, pause, load, resume, check, "
        "roll_back; a name with a '/', such as 'pause/probe_wait', 'pause/servers' or 'load/verify', is part of "
        "another phase) and 'unaccounted'.",
    )
    eval_accuracy: list[tuple[int, float]]
    reward_by_step: list[tuple[int, float]]
    reward_by_wall: list[tuple[float, float]]
    accuracy_by_wall: list[tuple[float, float]] = Field(
        default_factory=list, description="(s since the first step, held-out accuracy) at the end of each eval's step."
    )
    samples_per_s: float
    tokens_per_s: float
    ideal_wall_s: float = Field(description="max(rollout busy, trainer busy): the wall time of a perfect overlap.")
    ratio_to_ideal: float = Field(description="ideal_wall_s / wall_s (1 = perfect overlap).")
    weight_sync_mean_s: float | None


class ReportPublic(_Out):
    id: int
    kind: str = Field(description="The bench that wrote it: schedules, precision, algorithms or weights.")
    title: str
    created_at: UtcDatetime
    job_ids: list[int] = Field(description="The jobs it ran, in the same store.")


class ReportDetail(ReportPublic):
    markdown: str = Field(description="The report as `report.md` holds it; images link the files by name.")
    files: list[str] = Field(description="Names of its files (PNG plots): GET /reports/{id}/files/{name}.")


class SpecCheck(BaseModel):
    spec: dict[str, Any] = Field(description="The spec as a job would run it: defaults filled in, paths absolute.")


class LogSource(BaseModel):
    name: str = Field(
        description="`driver`, `engine-<i>` for SGLang server i, or `engine-<i>.restart-<n>` for server i after its "
        "n-th restart; the `source` of get_logs."
    )
    size_bytes: int = Field(description="The log's size now.")
    description: str


class PresetPublic(BaseModel):
    name: str = Field(description="The file's name without .yaml.")
    spec_yaml: str = Field(description="The job spec as the file writes it.")


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
    created_at: UtcDatetime


class SamplePublic(_Out):
    step: int
    prompt: str
    response: str
    label: str | None
    reward: float
    status: str
    weight_versions: list[int]
    num_tokens: int | None = Field(None, description="The response's length in tokens (None: stored before it was).")
    logprobs: list[float] | None = Field(None, description="The engine's logprob of each response token.")
    turns: list[dict[str, Any]] | None = Field(None, description="A multi-turn episode's messages, {role, content}.")
    images: list[str] | None = Field(
        None, description="The prompt's images (a vision-language model's), as PNG data URIs at most 256 px a side."
    )


class ScheduleChangePublic(_Out):
    id: int
    patch: dict[str, Any]
    status: str
    message: str
    applied_step: int | None
    requested_at: UtcDatetime


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    store: str = Field(
        description="ok, or why the server cannot read or write its store (a failed write, a full disk)."
    )
    ray: str = Field(
        description="ok, not started (the local head starts with the first job), or why it is unreachable."
    )
    launcher: str
    launcher_error: str | None
    version: str
