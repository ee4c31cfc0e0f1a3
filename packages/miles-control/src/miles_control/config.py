"""The job spec: one YAML file composed of each package's own config models.

Imports only pydantic (and the packages' config modules, which import only pydantic), so the API
and the CLI validate a job without importing torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from miles_rollout.config import DataConfig, RolloutConfig
from miles_sync.config import SyncConfig
from miles_train.config import TrainConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BuiltinModelConfig(_Strict):
    """A tiny Qwen2 with a character tokenizer, built from code and warm-started on arithmetic.

    Cached by content: the same fields give the same folder without rebuilding.
    """

    source: Literal["builtin"] = "builtin"
    name: Literal["tiny-qwen2-arithmetic"] = "tiny-qwen2-arithmetic"
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(512, gt=0)
    warm_start_steps: int = Field(240, ge=0, description="Supervised steps before RL (0 = random init).")
    warm_start_lr: float = Field(1e-3, gt=0)
    warm_start_batch_size: int = Field(64, gt=0)
    seed: int = 0


class PathModelConfig(_Strict):
    """An existing HF model folder (config, weights, tokenizer)."""

    source: Literal["path"]
    path: str


ModelConfig = Annotated[BuiltinModelConfig | PathModelConfig, Field(discriminator="source")]


class ScheduleConfig(_Strict):
    type: Literal["sync"] = "sync"
    num_steps: int = Field(300, gt=0)
    max_minutes: float | None = Field(None, gt=0, description="Stop after this much wall time (after a whole step).")
    stop_at_accuracy: float | None = Field(
        None, gt=0, le=1, description="Stop once held-out accuracy reaches this value."
    )
    save_final: bool = Field(False, description="Save a trainer checkpoint at the end of the run.")


class StoreConfig(_Strict):
    url: str = Field("sqlite:///.miles/miles.db", description="SQLAlchemy URL of the job store.")


class RayConfig(_Strict):
    address: str | None = Field(None, description="Ray cluster address; None starts a local instance.")
    num_cpus: int | None = Field(None, gt=0, description="CPUs of the local instance; None = all.")
    trainer_cpus_per_rank: float = Field(0.5, ge=0)
    rollout_cpus: float = Field(0.5, ge=0)


class JobSpec(_Strict):
    """Everything one run needs. Unknown fields are errors."""

    name: str = Field(min_length=1)
    seed: int = 0
    model: ModelConfig = Field(default_factory=BuiltinModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    output_dir: str = Field(".miles/runs", description="Where runs write weights and checkpoints.")
