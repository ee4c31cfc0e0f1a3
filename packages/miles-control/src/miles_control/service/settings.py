"""Settings of the API server, from the environment (`MILES_*`) or `miles serve` options."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from miles_control.spec.config import DEFAULT_STORE_URL


class JobLimits(BaseModel):
    """The most a job submitted over the API may ask for, and the least CPU it must reserve (a job that
    reserves nothing would bypass the queue). Each bounds the spec fields its description names (their paths in
    `miles_control.service.api.policy.LIMITED`): every number of a spec that sizes memory, time, processes or disk is bounded
    here or by the spec itself. Set one with `MILES_LIMITS__<NAME>`, e.g. `MILES_LIMITS__WORLD_SIZE=64`."""

    world_size: int = Field(16, gt=0, description="train.backend.world_size (and its tensor/expert parallel sizes)")
    num_engines: int = Field(16, gt=0, description="rollout.engine.num_engines")
    num_steps: int = Field(100_000, gt=0, description="schedule.num_steps")
    max_minutes: float = Field(7 * 24 * 60, gt=0, description="schedule.max_minutes")
    num_prompts_per_step: int = Field(4096, gt=0, description="rollout.num_prompts_per_step")
    num_samples_per_prompt: int = Field(256, gt=0, description="rollout.num_samples_per_prompt")
    max_new_tokens: int = Field(32_768, gt=0, description="rollout.sampling.max_new_tokens")
    max_total_tokens: int = Field(
        4_000_000, gt=0, description="rollout.engine.max_total_tokens, rollout.multi_turn.max_total_tokens"
    )
    hidden_size: int = Field(8192, gt=0, description="model.hidden_size (the built-in model)")
    num_layers: int = Field(64, gt=0, description="model.num_layers (the built-in model)")
    num_heads: int = Field(256, gt=0, description="model.num_heads, model.num_kv_heads (the built-in model)")
    intermediate_size: int = Field(32_768, gt=0, description="model.intermediate_size (the built-in model)")
    warm_start_steps: int = Field(100_000, ge=0, description="model.warm_start_steps (the built-in model)")
    batch_size: int = Field(
        65_536,
        gt=0,
        description="model.warm_start_batch_size, rollout.engine.max_batch_size, rollout.engine.max_requests_per_call, "
        "rollout.remote_reward.batch_size",
    )
    num_train: int = Field(1_000_000, gt=0, description="data.num_train (prompts generated in memory)")
    num_eval: int = Field(100_000, gt=0, description="data.num_eval, rollout.eval.num_prompts")
    num_threads: int = Field(
        256, gt=0, description="rollout.engine.num_threads, train.backend.num_threads, ray.num_cpus, "
        "rollout.remote_reward.max_concurrent_requests",
    )  # fmt: skip
    timeout_s: float = Field(
        86_400,
        gt=0,
        description="every wait a spec sets: rollout.engine.*_timeout_s and health_interval_s, "
        "rollout.multi_turn.step_timeout_s, rollout.remote_reward.timeout_s and backoff_s, sync.*timeout_s",
    )
    restarts: int = Field(
        100, ge=0, description="rollout.engine.max_restarts, schedule.max_restarts, rollout.remote_reward.max_retries"
    )
    max_turns: int = Field(1000, gt=0, description="rollout.multi_turn.max_turns")
    bucket_bytes: int = Field(8 << 30, gt=0, description="sync.bucket_bytes")
    group_size: int = Field(1 << 20, gt=0, description="sync.quant_group_size, train.quant_group_size")
    keep: int = Field(100, gt=0, description="sync.keep_versions, schedule.keep_checkpoints (disk)")
    max_buckets_in_flight: int = Field(64, gt=0, description="sync.max_buckets_in_flight")
    num_minibatches: int = Field(4096, gt=0, description="train.algorithm.num_minibatches")
    lora_rank: int = Field(4096, gt=0, description="train.lora.rank")
    buffer: int = Field(100_000, gt=0, description="schedule.buffer_groups, schedule.max_staleness")
    min_trainer_cpus_per_rank: float = Field(0.1, ge=0, description="ray.trainer_cpus_per_rank, at least")
    min_rollout_cpus: float = Field(0.1, ge=0, description="ray.rollout_cpus, at least")


class ServerSettings(BaseSettings):
    """Where the server keeps state, which paths job specs may name, and how it launches jobs."""

    model_config = SettingsConfigDict(env_prefix="MILES_", extra="ignore", env_nested_delimiter="__")

    store_url: str = Field(DEFAULT_STORE_URL, description="SQLAlchemy URL of the job store.")
    data_dir: Path = Field(Path(".miles"), description="Server state: driver logs, run folders, the local Ray.")
    data_root: Path = Field(Path("data"), description="Prompt files named by job specs must lie under it.")
    model_root: Path = Field(Path("models"), description="Model folders named by job specs must lie under it.")
    presets_dir: Path = Field(
        Path("examples"), description="Job specs (*.yaml) offered as presets by GET /presets (the dashboard's)."
    )
    plugin_modules: list[str] = Field(
        default_factory=list,
        description="Installed modules (and their submodules) whose functions specs may name as rewards by "
        "dotted path. Empty: only registered reward names.",
    )
    launcher: Literal["local", "ray_job", "off"] = Field(
        "local",
        description="local: a driver process per job on this machine, joined to the local Ray instance; ray_job: "
        "Ray's job submission API at `ray_address`; off: jobs stay queued (tests, read-only replicas).",
    )
    ray_address: str | None = Field(
        None,
        description="local: an existing Ray instance (GCS address) instead of one started on demand; "
        "ray_job: the cluster's dashboard URL, e.g. http://head:8265.",
    )
    driver_python: str = Field(
        "python", description="ray_job: the interpreter of the cluster that runs `-m miles_control.service.driver`."
    )
    cpus: float = Field(
        default_factory=lambda: float(os.cpu_count() or 1),
        gt=0,
        description="CPUs jobs may use at once; a job waits in the queue until its share is free.",
    )
    gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs jobs may use; a job whose resource plan needs more is refused at submission. None: the "
        "GPUs of this machine (launcher local: CUDA_VISIBLE_DEVICES, else the NVIDIA driver's list) or of the "
        "cluster's alive nodes (launcher ray_job: asked of its dashboard at each submission; not checked when it "
        "does not answer, the job then checks at its start).",
    )
    token_cache_s: float = Field(
        5.0, ge=0, description="How long a checked token is trusted without a query; a revoke applies within it."
    )
    max_body_bytes: int = Field(1 << 20, gt=0, description="Larger request bodies get 413.")
    limits: JobLimits = Field(
        default_factory=JobLimits, description="Bounds on what an API job may ask for (MILES_LIMITS__<NAME>)."
    )
    poll_interval_s: float = Field(1.0, gt=0, description="How often the launcher looks at the queue.")
    cancel_grace_s: float = Field(
        60.0, gt=0, description="After a cancel, how long a driver has to stop before it is killed."
    )

    @property
    def runs_root(self) -> Path:
        return (self.data_dir / "runs").resolve()

    @property
    def logs_root(self) -> Path:
        return (self.data_dir / "logs").resolve()
