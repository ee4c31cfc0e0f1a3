"""Rollout configuration. Imports only pydantic, so a job spec validates without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PauseMode = Literal["in_place", "retract", "abort"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HFEngineConfig(_Strict):
    """In-process transformers engine: batched sampling with a KV cache."""

    type: Literal["hf"] = "hf"
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_batch_size: int = Field(1024, gt=0, description="Sequences decoded together in one forward pass.")
    num_threads: int | None = Field(None, gt=0, description="torch threads for this engine; None keeps torch's.")


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(8, gt=0)
    stop: list[str] = Field(default_factory=list, description="Stop strings; each must be one token.")


class EvalConfig(_Strict):
    every_steps: int = Field(10, ge=0, description="Evaluate every N steps (0 = only at start and end).")
    num_prompts: int = Field(256, gt=0)
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy accuracy.")


class RolloutConfig(_Strict):
    """What the rollout side does each step."""

    engine: HFEngineConfig = Field(default_factory=HFEngineConfig)
    num_prompts_per_step: int = Field(64, gt=0)
    num_samples_per_prompt: int = Field(8, gt=0, description="Group size n for GRPO.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    reward: str = Field(
        "exact_match",
        description="A registered reward name or a dotted path `package.module:function`.",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)


class DataConfig(_Strict):
    """Prompts from a JSONL or Parquet file, or from the built-in arithmetic generator."""

    source: Literal["file", "arithmetic"] = "arithmetic"
    path: str | None = Field(None, description="JSONL or Parquet file when source=file.")
    eval_path: str | None = Field(None, description="Held-out prompts when source=file.")
    prompt_key: str = "prompt"
    label_key: str = "label"
    seed: int = 0
    num_train: int = Field(20000, gt=0, description="arithmetic: number of training prompts.")
    num_eval: int = Field(500, gt=0, description="arithmetic: number of held-out prompts.")
    digits: int = Field(2, ge=1, le=6, description="arithmetic: digits per operand.")
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"])
