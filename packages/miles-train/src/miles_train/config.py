"""Training configuration. Imports only pydantic, so a job spec validates without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # no inf or NaN: JSON and the store cannot hold them


class FSDP2Config(_Strict):
    """HF model sharded with torch FSDP2 (`fully_shard`) over gloo (CPU) or NCCL (GPU)."""

    type: Literal["fsdp2"] = "fsdp2"
    world_size: int = Field(1, ge=1, description="Data-parallel trainer ranks.")
    mixed_precision: Literal["none", "bf16"] = Field("none", description="bf16 compute, fp32 master weights.")
    num_threads: int | None = Field(None, gt=0, description="torch threads per rank; None keeps torch's.")


class OptimizerConfig(_Strict):
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient norm; None disables.")


class GRPOConfig(_Strict):
    """Group-normalised advantages with a clipped ratio loss (token-mean aggregation)."""

    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, gt=0, description="Upper clip; None uses clip_eps.")
    normalize_std: bool = Field(True, description="Divide advantages by the group's standard deviation.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the k3 KL to the frozen reference (0 = no reference).")
    old_logprobs: Literal["rollout", "recompute"] = Field(
        "rollout", description="Behaviour logprobs of the ratio: the engine's, or recomputed by the trainer."
    )
    num_minibatches: int = Field(1, ge=1, description="Optimizer steps per batch.")
    loss_aggregation: Literal["token_mean"] = "token_mean"
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling: weight each token's loss by min(π_old/π_rollout, tis_cap), "
        "π_old recomputed by the trainer (needs old_logprobs: recompute). None: off.",
    )
    staleness: Literal["none", "decay", "drop"] = Field(
        "none",
        description="Staleness-aware weighting of off-policy samples: decay multiplies a sample's loss by "
        "staleness_decay ** staleness; drop zeroes samples older than staleness_max.",
    )
    staleness_decay: float = Field(0.5, gt=0, le=1)
    staleness_max: int = Field(1, ge=0, description="staleness: drop keeps samples at most this many versions old.")

    @model_validator(mode="after")
    def _tis_needs_recompute(self) -> GRPOConfig:
        if self.tis_cap is not None and self.old_logprobs != "recompute":
            raise ValueError("tis_cap needs old_logprobs: recompute (the trainer's old-policy logprobs)")
        return self


class TrainConfig(_Strict):
    backend: FSDP2Config = Field(default_factory=FSDP2Config)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
