"""The job spec: one YAML file composed of each package's own config models.

Imports only pydantic (and the packages' config modules, which import only pydantic), so the API
and the CLI validate a job without importing torch. The model sources (`model_sources.py`) and the schedules'
settings (`schedule_config.py`) live beside it and are importable from here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from miles_control.spec.model_sources import (
    BuiltinModelConfig,
    HubModelConfig,
    ModelConfig,
    PackagedModelConfig,
    PathModelConfig,
    check_repo_id,
)
from miles_control.spec.schedule import (
    LIVE_SCHEDULE_FIELDS,
    SCHEDULES,
    FullyAsyncSchedule,
    OneStepOffSchedule,
    OverlappedSchedule,
    ScheduleBase,
    ScheduleConfig,
    ScheduleType,
    SyncSchedule,
    as_schedule,
    schedule_config,
)
from miles_rollout.config import DataConfig, RolloutConfig
from miles_sync.config import DiskSync, SpecModel, SyncConfig
from miles_train.config import TrainConfig

__all__ = [
    "DEFAULT_STORE_URL",
    "LIVE_SCHEDULE_FIELDS",
    "SCHEDULES",
    "BuiltinModelConfig",
    "FullyAsyncSchedule",
    "HubModelConfig",
    "JobSpec",
    "MLflowTracker",
    "ModelConfig",
    "OneStepOffSchedule",
    "OverlappedSchedule",
    "PackagedModelConfig",
    "PathModelConfig",
    "RayConfig",
    "ResourcesConfig",
    "ScheduleBase",
    "ScheduleConfig",
    "ScheduleType",
    "StoreConfig",
    "SyncSchedule",
    "TensorBoardTracker",
    "TrackerConfig",
    "WandbTracker",
    "as_schedule",
    "check_repo_id",
    "resources_fit_the_job",
    "schedule_config",
]

DEFAULT_STORE_URL = "sqlite:///.miles/miles.db"  # the store of `miles run`, `miles serve` and the CLI by default


class _Strict(SpecModel):
    """A section of the job spec: unknown fields, inf/NaN and booleans for numbers are refused (miles_sync.config)."""


class _TrackerBase(_Strict):
    project: str = Field("miles", description="W&B project / MLflow experiment / TensorBoard subfolder.")
    run_name: str | None = Field(None, description="The run's name in the tracker; None: `<job name>-job<id>`.")
    tags: list[str] = Field(default_factory=list, description="W&B tags; MLflow tags (with empty values).")
    dir: str | None = Field(None, description="Where the tracker writes locally; None: `<output_dir>/tracking/<type>`.")


class WandbTracker(_TrackerBase):
    """Weights & Biases, through `wandb` (`pip install "miles-control[tracking]"`). Online it needs an API key
    (`WANDB_API_KEY` or `wandb login`); offline it writes the run under `dir` for a later `wandb sync`."""

    type: Literal["wandb"]
    mode: Literal["online", "offline"] = Field("online", description="offline: write locally, sync later.")
    entity: str | None = Field(None, description="The W&B team or user; None: the key's default.")


class TensorBoardTracker(_TrackerBase):
    """TensorBoard event files under `dir/project/run_name`, written through `torch.utils.tensorboard` (the
    `tensorboard` package); `tensorboard --logdir <dir>` shows them."""

    type: Literal["tensorboard"]


class MLflowTracker(_TrackerBase):
    """MLflow, through `mlflow` (or `mlflow-skinny`): a run in experiment `project`."""

    type: Literal["mlflow"]
    tracking_uri: str | None = Field(
        None,
        description="None: `MLFLOW_TRACKING_URI` when set, else a SQLite store `sqlite:///<dir>/mlflow.db` (MLflow's "
        "plain-folder store is in maintenance mode).",
    )


TrackerConfig = Annotated[WandbTracker | TensorBoardTracker | MLflowTracker, Field(discriminator="type")]


class StoreConfig(_Strict):
    url: str = Field(DEFAULT_STORE_URL, description="SQLAlchemy URL of the job store.")
    samples_per_step: int = Field(4, ge=0, le=64, description="Generations kept per step for people to read.")


class ResourcesConfig(_Strict):
    """Where the job's processes run and which GPUs they hold (the planner, `miles_control.job.placement`, turns this
    into Ray placement groups before anything starts)."""

    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="disaggregated: trainer and engines on their own GPUs (they can overlap: every schedule). "
        "colocated: the engines share the trainer's GPUs, releasing their memory while it steps (sync schedule, "
        "SGLang, transport tensor or disk).",
    )
    trainer_gpus_per_rank: int | Literal["auto"] = Field(
        "auto", description="GPUs each trainer rank holds; auto: 1 on a cluster with GPUs, else 0 (CPU)."
    )
    rollout_gpus_per_engine: int | Literal["auto"] = Field(
        "auto",
        description="GPUs of each SGLang server (its --tp-size × --dp-size); auto: that product on a cluster with "
        "GPUs, else 0 (CPU). The hf engine runs on CPU.",
    )
    trainer_node: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each trainer rank also asks for, to choose its node (a node started "
        "with `ray start --resources '{\"trainer\": 8}'` and trainer_node: {trainer: 1}).",
    )
    rollout_node: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources the rollout worker also asks for (its node)."
    )
    trainer_labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node labels the trainer ranks' node must carry (`ray start --labels`)."
    )
    rollout_labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node labels the rollout worker's node must carry."
    )

    @field_validator("trainer_gpus_per_rank", "rollout_gpus_per_engine")
    @classmethod
    def _not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be ≥ 0 or auto")
        return value

    @field_validator("trainer_node", "rollout_node")
    @classmethod
    def _positive_amounts(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if not name or amount <= 0:
                raise ValueError(f"Ray resource {name!r}: {amount} must be a named amount > 0")
        return value


def resources_fit_the_job(spec: JobSpec) -> None:
    """What the resource plan must agree with in the rest of the spec (the cluster is checked at start-up)."""
    res, engine = spec.resources, spec.rollout.engine
    gpus = res.rollout_gpus_per_engine
    if isinstance(gpus, int) and (problem := engine.gpus_problem(gpus)) is not None:
        raise ValueError(f"resources.rollout_gpus_per_engine: {problem}")
    if res.mode != "colocated":
        return
    # (field, its value, whether colocated works with it, why not)
    checks = [
        ("rollout.engine.type", engine.type, engine.releases_memory,
         "the engines must release their GPU memory while the trainer steps, which SGLang does"),
        ("schedule.type", spec.schedule.type, spec.schedule.type == "sync",
         "generation and training take turns on the same GPUs, so they cannot overlap"),
        ("sync.transport", spec.sync.transport, spec.sync.transport in ("tensor", "disk"),
         "broadcast would put two NCCL ranks on one GPU; use tensor (CUDA IPC on the same device) or disk"),
        ("resources.trainer_gpus_per_rank", res.trainer_gpus_per_rank, res.trainer_gpus_per_rank in (1, "auto"),
         "each rank holds one GPU, which the engines share"),
        ("sync.delta", spec.sync.delta, not spec.sync.delta,
         "the engines release their weights' memory while the trainer steps, so every push must refill all of it"),
    ]  # fmt: skip
    for name, value, ok, why in checks:
        if not ok:
            raise ValueError(f"resources.mode: colocated does not work with {name}: {value}: {why}")
    if (problem := engine.colocated_problem(spec.train.backend.world_size)) is not None:
        raise ValueError(f"resources.mode: colocated puts the engines on the trainer's GPUs: {problem}")


class RayConfig(_Strict):
    address: str | None = Field(None, description="Ray cluster address; None starts a local instance.")
    num_cpus: int | None = Field(None, gt=0, description="CPUs of the local instance; None = all.")
    trainer_cpus_per_rank: float = Field(0.5, ge=0)
    rollout_cpus: float = Field(0.5, ge=0)
    cpu_split: bool = Field(
        False,
        description="Pin trainer ranks and the rollout actor (with its SGLang servers) to disjoint CPU cores of "
        "this machine, so that generation and training can overlap on a small machine. "
        "Applied only where they overlap (one_step_off, fully_async), in halves and then, after 3 steps, in the "
        "shares that make both stages take as long (from their measured busy time); under sync the stages take "
        "turns and each uses every core.",
    )


class JobSpec(_Strict):
    """Everything one run needs. Unknown fields are errors."""

    name: str = Field(min_length=1, max_length=200, description="Shown in lists; at most 200 characters.")
    kind: Literal["rl", "sft"] = Field(
        "rl",
        description="rl: generate, score, train (the algorithm of train.algorithm). sft: supervised fine-tuning on the "
        "prompts' labels as responses (a JSONL of prompt/response pairs: data.label_key defaults to `response`), with "
        "the same backends, pushes, held-out evaluation and store; it sets rollout.generate: supervised, "
        "rollout.num_samples_per_prompt: 1 and train.algorithm: sft where the spec leaves them out.",
    )
    seed: int = 0
    model: ModelConfig = Field(default_factory=BuiltinModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sync: SyncConfig = Field(default_factory=DiskSync)
    schedule: ScheduleConfig = Field(default_factory=SyncSchedule)
    store: StoreConfig = Field(default_factory=StoreConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    output_dir: str = Field(".miles/runs", description="Where runs write weights and checkpoints.")
    tracking: list[TrackerConfig] = Field(
        default_factory=list,
        description="Experiment trackers that get every metric beside the store: `[wandb, tensorboard, mlflow]`, or "
        "objects with their settings. One that fails warns once and the run goes on without it.",
    )

    @field_validator("tracking", mode="before")
    @classmethod
    def _tracker_names(cls, value: Any) -> Any:
        """`tracking: [wandb]` is `tracking: [{type: wandb}]`; each tracker at most once."""
        if not isinstance(value, list):
            return value
        value = [{"type": v} if isinstance(v, str) else v for v in value]
        seen = [v.get("type") for v in value if isinstance(v, dict)]
        twice = sorted({t for t in seen if seen.count(t) > 1 and isinstance(t, str)})
        if twice:
            raise ValueError(f"{', '.join(twice)} given more than once")
        return value

    @model_validator(mode="before")
    @classmethod
    def _sft_defaults(cls, data: Any) -> Any:
        """`kind: sft` fills what supervised fine-tuning needs where the spec leaves it out."""
        if not (isinstance(data, dict) and data.get("kind") == "sft"):
            return data
        # a section that is not a mapping is left as it is: its own validation names it (never a server error)
        if not all(isinstance(data.get(k) or {}, dict) for k in ("rollout", "train")):
            return data
        rollout = dict(data.get("rollout") or {})
        rollout.setdefault("generate", "supervised")
        rollout.setdefault("num_samples_per_prompt", 1)
        train = dict(data.get("train") or {})
        algorithm = train.setdefault("algorithm", "sft")
        if isinstance(algorithm, dict) and "name" not in algorithm:  # settings given, the objective left out
            train["algorithm"] = {**algorithm, "name": "sft"}
        out = {**data, "rollout": rollout, "train": train}
        source = data.get("data")
        if isinstance(source, dict) and source.get("source") in ("file", "hf") and "label_key" not in source:
            out["data"] = {**source, "label_key": "response"}
        return out

    @model_validator(mode="after")
    def _kind_fits(self) -> JobSpec:
        rollout, algorithm = self.rollout, self.train.algorithm.name
        if self.kind == "sft":
            wrong = [
                f"{field} is {value!r}"
                for field, value, wanted in (
                    ("rollout.generate", rollout.generate, "supervised"),
                    ("train.algorithm", algorithm, "sft"),
                    ("rollout.num_samples_per_prompt", rollout.num_samples_per_prompt, 1),
                    ("rollout.dynamic_sampling", rollout.dynamic_sampling, None),
                    ("rollout.sampling.temperature", rollout.sampling.temperature, 1.0),  # the likelihood's
                    (
                        "train.algorithm.tis_cap",
                        self.train.algorithm.tis_cap,
                        None,
                    ),  # the rollout logprobs are unknown (0)
                    ("train.algorithm.mis_band", self.train.algorithm.mis_band, None),
                )
                if value != wanted
            ]
            if wrong:
                raise ValueError(
                    "kind: sft trains on the labels as responses (rollout.generate: supervised, train.algorithm: sft, "
                    "one sample per prompt at temperature 1, no dynamic sampling, no correction of rollout logprobs), "
                    f"but {'; '.join(wrong)}"
                )
        if rollout.dynamic_sampling is not None and algorithm == "distill":
            raise ValueError(
                "rollout.dynamic_sampling drops groups whose rewards agree; distill learns from the teacher's "
                "logprobs, not the rewards: turn one of them off"
            )
        if rollout.generate == "supervised" or algorithm == "sft":
            if self.kind == "sft":
                return self
            raise ValueError(
                "rollout.generate: supervised and train.algorithm: sft are supervised fine-tuning: set kind: sft "
                "(they make no sense apart: an RL objective on the labels, or the labels' likelihood of samples)"
            )
        return self

    @model_validator(mode="after")
    def _quantization_grids_agree(self) -> JobSpec:
        sync, train = self.sync, self.train
        if sync.quantization == train.quantization == "int4" and sync.quant_group_size != train.quant_group_size:
            raise ValueError(
                f"train.quant_group_size {train.quant_group_size} ≠ sync.quant_group_size {sync.quant_group_size}: "
                "with int4 on both sides the trainer would compute on another grid than the engines run"
            )
        engine = self.rollout.engine
        resources_fit_the_job(self)
        if sync.quant_wire == "packed" and (where := engine.packed_weights_refusal()) is not None:
            raise ValueError(
                f"sync.quant_wire: packed needs SGLang on a GPU, and this job has {where}: only SGLang's fp8 "
                "kernels load packed weights; use sync.quant_wire: values (the weight-only emulation)"
            )
        return self

    @model_validator(mode="after")
    def _environment_data(self) -> JobSpec:
        """data.source environment reads a verifiers environment's dataset: its prompts are conversations."""
        env = self.rollout.environment
        if self.data.source == "environment" and getattr(env, "type", None) != "verifiers":
            raise ValueError(f"data.source: environment reads the dataset of a verifiers environment, not {env!r}")
        if self.data.source == "environment" and self.data.chat_template == "none":
            raise ValueError("data.chat_template: a verifiers environment's prompts are conversations; set model")
        return self

    @model_validator(mode="after")
    def _routing_replay_has_routing(self) -> JobSpec:
        """train.routing_replay replays what the engine returns: both engines return it once asked
        (rollout.engine.routed_experts, turned on here)."""
        if not self.train.routing_replay:
            return self
        engine = self.rollout.engine
        if not engine.routed_experts:
            self.rollout.engine = engine.model_copy(update={"routed_experts": True})
        return self

    @model_validator(mode="after")
    def _lora_fits(self) -> JobSpec:
        """An adapter (train.lora) needs a push the engine can take: refused here, before anything starts."""
        sync = self.sync
        if self.train.lora is None:
            return self
        if sync.transport == "p2p":
            raise ValueError(
                "train.lora with sync.transport: p2p: p2p sends each trainer rank's rows of the model's own tensors, "
                "and an adapter's push is small enough for rank 0 to send whole; use transport disk, tensor or "
                "broadcast"
            )
        if sync.lora == "adapter":
            refusal = self.rollout.engine.adapter_delta_refusal()
            if refusal is not None and sync.delta:
                raise ValueError(
                    f"sync.delta with sync.lora: adapter on the {self.rollout.engine.type} engine: {refusal}; turn "
                    "sync.delta off"
                )
            if sync.quantization != "none":
                raise ValueError(
                    f"sync.quantization: {sync.quantization} with sync.lora: adapter: the engines would run a "
                    "quantized adapter on an unquantized base; use sync.lora: merge to quantize the merged weights"
                )
        return self

    @field_validator("schedule", mode="before")
    @classmethod
    def _sync_by_default(cls, value: Any) -> Any:
        if isinstance(value, dict) and "type" not in value:
            return {**value, "type": "sync"}
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _source_by_default(cls, value: Any) -> Any:
        """A mapping without `source`: a `path` is a folder, a packaged model's `name` is that model, anything
        else the built-in model's fields (as the default is)."""
        if isinstance(value, dict) and "source" not in value:
            if "path" in value:
                return {**value, "source": "path"}
            packaged = get_args(PackagedModelConfig.model_fields["name"].annotation)
            return {**value, "source": "package" if value.get("name") in packaged else "builtin"}
        return value
