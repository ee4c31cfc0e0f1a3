"""Training configuration. Imports only pydantic, so a job spec validates without torch."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from miles_sync.config import QUANT_DESCRIPTION, QuantFormat, SpecModel
from miles_train.algorithm_config import ALGORITHMS, RL_ALGORITHMS, Aggregation, AlgorithmConfig
from miles_train.spec_upgrade import upgrade_train_spec

Precision = Literal["fp32", "bf16", "fp16"]


class _Strict(SpecModel):
    """A section of the job spec: unknown fields, inf/NaN and booleans for numbers are refused (miles_sync.config)."""


__all__ = ["ALGORITHMS", "RL_ALGORITHMS", "Aggregation", "AlgorithmConfig"]  # train.algorithm: algorithm_config.py


class FSDP2Config(_Strict):
    """HF model sharded with torch FSDP2 (`fully_shard`) over gloo (CPU) or NCCL (GPU)."""

    type: Literal["fsdp2"] = "fsdp2"
    world_size: int = Field(1, ge=1, description="Data-parallel trainer ranks.")
    num_threads: int | None = Field(None, gt=0, description="torch threads per rank; None keeps torch's.")


class _ModelParallel(_Strict):
    world_size: int = Field(1, ge=1, description="Trainer ranks in all: tensor_parallel_size × data-parallel ranks.")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks that split each layer (Megatron-style TP).")
    num_threads: int | None = Field(None, gt=0, description="torch threads per rank; None keeps torch's.")

    @model_validator(mode="after")
    def _tp_divides_world(self):
        if self.world_size % self.tensor_parallel_size:
            raise ValueError(
                f"world_size ({self.world_size}) must be a multiple of tensor_parallel_size "
                f"({self.tensor_parallel_size}): the data-parallel size is their quotient"
            )
        return self

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_parallel_size


class MegatronConfig(_ModelParallel):
    """megatron-core GPTModel (local layer spec) built from the HF config; Megatron DDP and optimizer.

    HF weights are converted on load and converted back by `export_weights`."""

    type: Literal["megatron"] = "megatron"
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="A mixture of experts: ranks its experts are split over (each holds num_experts / this many "
        "whole experts; tokens travel to their experts' ranks). It must divide world_size; tensor_parallel_size 1.",
    )

    @model_validator(mode="after")
    def _ep_divides_world(self):
        if self.world_size % (self.expert_parallel_size * self.tensor_parallel_size):
            raise ValueError(
                f"world_size ({self.world_size}) must be a multiple of expert_parallel_size "
                f"({self.expert_parallel_size}) × tensor_parallel_size ({self.tensor_parallel_size})"
            )
        return self


class TorchtitanConfig(_ModelParallel):
    """torchtitan's Qwen/Llama-family model with its own parallelisation (FSDP2 over the
    data-parallel ranks, TP over `tensor_parallel_size`) and an HF state-dict adapter."""

    type: Literal["torchtitan"] = "torchtitan"


BackendConfig = Annotated[FSDP2Config | MegatronConfig | TorchtitanConfig, Field(discriminator="type")]
BACKEND_TYPES = ("fsdp2", "megatron", "torchtitan")


class OptimizerConfig(_Strict):
    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient norm; None disables.")


class CriticConfig(_Strict):
    """PPO's value model and its advantage estimation (`train.algorithm: ppo`)."""

    model: str | None = Field(
        None,
        description="HF folder the value model starts from: its transformer (the LM head is not used) and, when the "
        "folder is a critic Miles saved (`<checkpoint>/critic`), its value head; otherwise the head starts at zero. "
        "None: the policy's checkpoint.",
    )
    lr: float | None = Field(
        None,
        gt=0,
        description="The critic's AdamW learning rate; None: 10 × train.optimizer.lr (a value head starts from "
        "zero and must catch up with the returns; PPO recipes commonly give the critic a larger rate than the actor).",
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the critic's global gradient norm; None disables.")
    value_clip: float | None = Field(
        0.2,
        gt=0,
        description="Clipped value loss: the new value may move at most this far from the value at rollout before "
        "the loss stops rewarding the move (max of the clipped and unclipped squared errors). None: plain squared "
        "error.",
    )
    gamma: float = Field(1.0, gt=0, le=1, description="GAE's discount per generated token.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE's λ: 0 is the one-step TD error, 1 the Monte-Carlo return.")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Strict):
    """LoRA through the PEFT library (`train.lora`): the base weights stay frozen, only the adapter's low-rank
    matrices A (rank × in) and B (out × rank) train, W' = W + (alpha / rank) · B A, and the optimizer holds state for
    them alone. What a push sends (the adapter, or the merged weights) is `sync.lora`."""

    rank: int = Field(8, gt=0, description="The adapter's rank r (PEFT's `r`).")
    alpha: float = Field(16.0, gt=0, description="The scale's numerator: the update is (alpha / rank) · B A.")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input while training (0: the trainer's forward is "
        "deterministic, as the engines' is).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="Names of the linear modules that get an adapter (PEFT's `target_modules`: a module whose name "
        "ends with one of them); the default is every attention and MLP projection of Llama/Qwen families.",
    )

    def peft_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of PEFT's `LoraConfig` (also what an engine that applies the adapter builds)."""
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": list(self.target_modules),
            "bias": "none",
        }


class TrainConfig(_Strict):
    backend: BackendConfig = Field(
        default_factory=FSDP2Config,
        description="The trainer backend: a mapping with `type` (fsdp2 | megatron | torchtitan) and its "
        "fields, or just the type's name for its defaults (`backend: megatron`).",
    )
    precision: Precision = Field(
        "fp32",
        description="Compute precision of the trainer's forward and backward, with fp32 master weights and optimizer "
        "state in every case; fp16 adds dynamic loss scaling (overflowing steps are skipped and counted). Each backend "
        "uses its framework's mechanism: FSDP2's MixedPrecisionPolicy (+ torch's ShardedGradScaler for fp16), "
        "Megatron's bf16/fp16 model config and mixed-precision optimizer, torchtitan's mixed_precision_param "
        "(bf16 only: torchtitan offers no fp16).",
    )
    allow_fp16: bool = Field(
        False,
        description="precision fp16 on a checkpoint whose config.json declares bfloat16 is refused before any model "
        "loads (a model trained in bf16 can carry activations past fp16's largest value, 65504); true trains it in "
        "fp16 anyway, the overflowing steps skipped and counted in train/overflow_skipped.",
    )
    quantization: QuantFormat = Field(
        "none",
        description="Fake-quantize the linear layers' weights in the trainer's forward passes (straight-through "
        "gradients to the fp32 master weights: QAT for int4, emulated low-precision training for the others), so the "
        "logprobs are computed under the numerics the engines use with the same sync.quantization. "
        + QUANT_DESCRIPTION,
    )
    quant_group_size: int = Field(128, gt=0, description="quantization: int4's group along the input dimension.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig,
        description="The algorithm: the objective (advantages, policy loss, aggregation) and the loss terms it "
        "combines (clipping, KL, entropy, off-policy corrections, minibatches); a mapping, or just the algorithm's "
        "name for its defaults (`algorithm: gspo`).",
    )
    teacher: str | None = Field(
        None,
        description="algorithm distill: the teacher, an HF model folder with the student's vocabulary. The trainer "
        "holds it frozen beside the policy (as it holds the KL reference) and scores the student's samples with it; "
        "it is read from this folder again on a resume.",
    )
    critic: CriticConfig | None = Field(
        None,
        description="algorithm ppo: the value model trained beside the policy and GAE's γ and λ (None: the "
        "defaults). Saved with every checkpoint (`<checkpoint>/critic`) and resumed with the policy.",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train a LoRA adapter (PEFT) instead of every weight: `{rank, alpha, dropout, target_modules}`, "
        "or `{}` for the defaults. Backends fsdp2 and torchtitan (tensor_parallel_size 1); megatron refuses it. "
        "sync.lora says whether a push "
        "sends the adapter or the merged weights. None: full fine-tuning.",
    )
    freeze: list[str] = Field(
        default_factory=list,
        description="Policy parameters not trained, as shell-style patterns over the names of the transformers model "
        "(`model.embed_tokens.*`, `model.layers.0.*`; a tied head is the embedding): no gradient, no optimizer state; "
        "each pattern must match a parameter (checked before start). With sync.delta a push never sends them after "
        "the first. Backend fsdp2; a PPO critic trains all of its own.",
    )
    routing_replay: bool = Field(
        False,
        description="A mixture of experts: the trainer's routers send each token to the experts the engine chose at "
        "rollout (the engine returns them), weighed with the trainer's own router probabilities. Off, the trainer "
        "routes on its own; either way train/routing_agreement reports how often both chose the same experts.",
    )
    policy_weights: Literal["auto", "master", "pushed"] = Field(
        "auto",
        description="The weights the trainer's forward passes use. pushed: the master weights rounded to the dtype "
        "the engines hold (gradients pass straight through to the fp32 master weights), so the policy trained is "
        "the policy that generated; master: the fp32 master weights as they are. auto: pushed when the engines "
        "hold a narrower dtype than the master weights (a bf16 checkpoint), master otherwise (then both are equal).",
    )

    @model_validator(mode="before")
    @classmethod
    def _stored_spec(cls, data: Any) -> Any:
        """A spec written by an earlier version reads as today's (miles_train.spec_upgrade)."""
        return upgrade_train_spec(data)

    @model_validator(mode="after")
    def _teacher_for_distill(self) -> TrainConfig:
        distill = self.algorithm.name == "distill"
        if distill and not self.teacher:
            raise ValueError("algorithm distill needs train.teacher: the teacher's HF model folder")
        if self.teacher and not distill:
            raise ValueError(f"train.teacher is the teacher of algorithm distill; this job's is {self.algorithm.name}")
        if distill and self.algorithm.kl_coef > 0:
            raise ValueError(
                "algorithm distill: the frozen model is the teacher, so algorithm.kl_coef must be 0 (the distillation "
                "signal already is the KL to the teacher)"
            )
        return self

    @model_validator(mode="after")
    def _critic_for_ppo(self) -> TrainConfig:
        if self.critic is not None and self.algorithm.name in ALGORITHMS and self.algorithm.name != "ppo":
            raise ValueError(
                f"train.critic is the value model of algorithm ppo; this job's is {self.algorithm.name} (which "
                "estimates advantages without a critic)"
            )
        return self

    @property
    def critic_config(self) -> CriticConfig:
        """train.critic, or its defaults."""
        return self.critic or CriticConfig()

    @property
    def needs_reference(self) -> bool:
        """Whether the trainer holds a frozen second model: the KL reference, or the distillation teacher."""
        return self.algorithm.kl_coef > 0 or self.teacher is not None

    @property
    def reference_is_base(self) -> bool:
        """Whether the KL reference is the policy's own model with its adapter switched off (`train.lora`, no
        teacher): the base weights stay frozen, so the trainer holds no second copy."""
        return self.lora is not None and self.teacher is None

    def reference_path(self, model_path: str) -> str:
        """Where the frozen model is read from: the teacher's folder, else the policy's checkpoint."""
        return self.teacher or str(model_path)

    @model_validator(mode="after")
    def _backend_can(self) -> TrainConfig:
        kind = self.backend.type
        if kind == "torchtitan" and self.precision == "fp16":
            raise ValueError(
                "train.precision: fp16 is not offered by torchtitan's mixed-precision settings (bfloat16 | float32); "
                "use precision bf16, or backend fsdp2 or megatron for fp16"
            )
        if self.lora is not None and kind == "megatron":
            raise ValueError(
                "train.lora: backend megatron cannot train an adapter (megatron-core 0.19 has no LoRA for its "
                "GPTModel layers, and PEFT wraps torch linears, not megatron's fused linear_qkv / linear_fc1); use "
                "backend fsdp2 or torchtitan"
            )
        tp = getattr(self.backend, "tensor_parallel_size", 1)
        if self.lora is not None and kind == "torchtitan" and tp > 1:
            raise ValueError(
                f"train.lora with train.backend.tensor_parallel_size {tp}: torchtitan's "
                "tensor-parallel plan shards plain linears, and PEFT's adapter layers replace them; use "
                "tensor_parallel_size 1 (FSDP2 over every rank) or backend fsdp2"
            )
        if self.freeze and kind != "fsdp2":
            raise ValueError(
                f"train.freeze: backend {kind} holds its parameters under its own names (fused, sharded), which "
                "patterns over the transformers model's names do not map onto yet; use backend fsdp2"
            )
        if self.freeze and self.lora is not None:
            raise ValueError("train.freeze with train.lora: LoRA already trains the adapter alone; use one of them")
        if self.lora is not None and self.quantization != "none":
            raise ValueError(
                f"train.lora with train.quantization: {self.quantization}: the fake quantization would round the "
                "adapter's matrices too, which the engines hold unquantized; use one of them"
            )
        if kind == "megatron" and self.quantization in ("fp8", "fp8_block", "nvfp4"):
            raise ValueError(
                f"train.quantization: {self.quantization} scales a whole HF tensor (per tensor or per 128×128 block), "
                "which megatron's fused and tensor-parallel weights (linear_qkv, linear_fc1) cannot reproduce; use "
                "int4 or mxfp8 (row-local scales) with backend megatron, or backend fsdp2 / torchtitan"
            )
        return self

    @field_validator("algorithm", mode="before")
    @classmethod
    def _algorithm_name_alone(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("backend", mode="before")
    @classmethod
    def _name_alone(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value not in BACKEND_TYPES:
                raise ValueError(f"unknown backend {value!r}; choose one of {', '.join(BACKEND_TYPES)}")
            return {"type": value}
        if isinstance(value, dict) and "type" not in value:
            raise ValueError(f"a backend mapping names its type: type: {' | '.join(BACKEND_TYPES)}")
        return value
