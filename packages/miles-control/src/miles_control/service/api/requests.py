"""Request bodies of the REST API (Create / Update): the server validates them against the job spec's own models
(miles_control.spec.config and the packages' configs), so they live apart from the torch-free response schemas."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from miles_control.spec.config import JobSpec
from miles_rollout.config import PauseMode


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


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
    pause_mode: PauseMode | None = None
    buffer_groups: int | None = Field(None, ge=1, le=1_000_000)
    push_between_batches: bool | None = None
