"""Rollout configuration. Imports only pydantic, so a job spec validates without torch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from miles_rollout.engine_config import (  # the rollout.engine section
    EngineConfig,
    HFEngineConfig,
    SGLangEngineConfig,
    _Strict,
    default_engine,
    gpus_per_server,
    tp_size,
)
from miles_rollout.environment_config import (  # rollout.judge and the hub environments of rollout.environment
    HubEnvironment,
    JudgeConfig,
    OpenEnvEnvironment,
    VerifiersEnvironment,
)

PauseMode = Literal["in_place", "retract", "abort"]
Operation = Literal["+", "-", "*"]  # arithmetic task operators


__all__ = [
    "EngineConfig",
    "HFEngineConfig",
    "HubEnvironment",
    "JudgeConfig",
    "OpenEnvEnvironment",
    "SGLangEngineConfig",
    "VerifiersEnvironment",
    "default_engine",
    "gpus_per_server",
    "tp_size",
]


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(8, gt=0)
    stop: list[str] = Field(default_factory=list, description="Stop strings; each must be one token.")
    ignore_eos: bool = Field(False, description="Generate exactly max_new_tokens (benchmarks).")


class EvalConfig(_Strict):
    every_steps: int = Field(10, ge=0, description="Evaluate every N steps (0 = only at start and end).")
    num_prompts: int = Field(256, gt=0)
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy accuracy.")


class MultiTurnConfig(_Strict):
    """Limits of the built-in episode runner (`rollout.generate: multi_turn`)."""

    max_turns: int = Field(4, gt=0, description="Model turns per episode.")
    max_total_tokens: int = Field(
        256, gt=1, description="Prompt and every turn of an episode: what the model's context must hold."
    )
    step_timeout_s: float = Field(30.0, gt=0, description="An environment step slower than this ends its episode.")
    tool_format: Literal["none", "hermes", "xml"] = Field(
        "none",
        description="How the model writes a tool call: hermes (<tool_call>{json}</tool_call>, Qwen2.5), "
        "xml (<call>text</call>), none (the environment reads the text).",
    )
    env_failures: Literal["train", "drop"] = Field(
        "train",
        description="An episode ended by its environment failing (env_error, env_timeout, bad_observation): train "
        "on it with the rewards it had (a tool the model called wrongly teaches it not to), or drop it from "
        "training as aborted (an outage of the environment is not the policy's doing).",
    )


class RemoteRewardConfig(_Strict):
    """An HTTP reward service (`rollout.reward: remote`): POST `{"samples": [...]}`, answer `{"rewards": [...]}`."""

    url: str = Field(description="The service's endpoint, http:// or https://.")
    batch_size: int = Field(64, gt=0, description="Samples per request; the requests of a step run concurrently.")
    max_concurrent_requests: int = Field(4, gt=0)
    timeout_s: float = Field(60.0, gt=0, description="Per request.")
    max_retries: int = Field(3, ge=0, description="Retries of a request that timed out, failed to connect or got 5xx.")
    backoff_s: float = Field(0.5, ge=0, description="Wait before the first retry; doubles with each.")
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Sent with every request. A value `${NAME}` is read from the environment variable NAME where the "
        "rollout runs (an API key: the spec is stored and shown as written; the API shows literal values redacted).",
    )

    @model_validator(mode="after")
    def _http(self) -> RemoteRewardConfig:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: {self.url!r} is not an http:// or https:// URL")
        return self


class CodeSandboxConfig(_Strict):
    """The sandbox of `rollout.reward: code` (`miles_rollout.sandbox`): isolation, limits of one execution, the pool."""

    tool: Literal["bwrap", "none"] = Field(
        "bwrap",
        description="bwrap: bubblewrap's namespaces (no network, only /usr of the host, read-only, an empty /tmp, "
        "no environment); none: the limits alone, without isolation (for machines where bubblewrap cannot run).",
    )
    python: str = Field("/usr/bin/python3", description="The interpreter, under /usr (the only host folder mounted).")
    workers: int = Field(2, gt=0, le=256, description="Executions at once.")
    queue: int = Field(
        256, gt=0, le=100_000, description="Executions waiting for a worker before the rollout waits too."
    )
    cpu_s: int = Field(5, gt=0, le=3600, description="CPU seconds of one execution.")
    wall_s: float = Field(10.0, gt=0, le=3600, description="Wall seconds of one execution.")
    memory_mb: int = Field(512, ge=64, le=65536, description="Address space of one execution.")
    processes: int = Field(
        16, gt=0, le=4096, description="Processes of one execution (enforced where Miles runs as root)."
    )
    output_bytes: int = Field(
        65536, gt=0, le=64 * 1024 * 1024, description="Output read back; past it the execution is killed."
    )
    file_mb: int = Field(16, gt=0, le=4096, description="Size of its /tmp and of any file it writes.")
    score: Literal["fraction", "all"] = Field(
        "fraction", description="fraction: the share of test cases passed; all: 1 only when every case passes."
    )


class DynamicSamplingConfig(_Strict):
    """DAPO's dynamic sampling (Yu et al. 2025): groups whose rewards all agree carry no advantage, so they are
    dropped, and the step is filled with informative groups instead. Each round launches `oversample` × the groups
    still missing; once the step has its `num_prompts_per_step` groups the requests still running are aborted in the
    engine. A round starts once the one before has drained. After `max_rounds` rounds a step still short is filled
    with dropped groups (their rewards agree: a group-baseline algorithm gives them advantages of exactly 0, though
    reinforce_pp's global normalisation, a KL in the reward and the entropy bonus still act on them) and
    `rollout/ds_padded_groups` counts them."""

    oversample: float = Field(1.5, ge=1.0, le=8.0, description="Prompts launched per group still missing, each round.")
    max_rounds: int = Field(4, ge=1, le=16, description="Rounds of generation per step before it is padded.")


class OverlongPenaltyConfig(_Strict):
    """DAPO's soft overlong punishment: a response within `buffer` tokens of max_new_tokens loses
    factor × (its length − (max_new_tokens − buffer)) / buffer from its reward, a full factor at max_new_tokens."""

    buffer: int = Field(gt=0, description="Tokens before max_new_tokens where the penalty starts.")
    factor: float = Field(1.0, gt=0, description="The penalty at max_new_tokens.")


class RolloutConfig(_Strict):
    """What the rollout side does each step."""

    engine: EngineConfig = Field(
        default_factory=default_engine, description="Default: sglang where it is installed, else hf."
    )
    num_prompts_per_step: int = Field(64, gt=0)
    num_samples_per_prompt: int = Field(8, gt=0, description="Group size n for GRPO.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    reward: str = Field(
        "exact_match",
        description="A registered reward name or a dotted path `package.module:function`.",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    generate: str = Field(
        "single_turn",
        description="single_turn, multi_turn (episodes with rollout.environment), supervised (the record's label is "
        "the response, teacher-forced: supervised fine-tuning, `kind: sft`), or a dotted path to an async "
        "function (record, client, sampling, ctx) returning samples.",
    )
    environment: str | HubEnvironment | None = Field(
        None,
        description="Dotted path to a factory (a class or function) making one environment per episode, or an "
        "environment from a hub: {type: verifiers, id, args} or {type: openenv, app | url, ...}.",
    )
    environment_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment factory."
    )
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    remote_reward: RemoteRewardConfig | None = Field(None, description="The service of `reward: remote`.")
    judge: JudgeConfig | None = Field(None, description="The judge model of `reward: judge`.")
    code_sandbox: CodeSandboxConfig = Field(
        default_factory=CodeSandboxConfig, description="The sandbox of `reward: code` (model-written Python, tested)."
    )
    dynamic_sampling: DynamicSamplingConfig | None = Field(
        None, description="Drop groups whose rewards all agree and fill the step with informative ones (None: off)."
    )
    partial_rollouts: bool = Field(
        False,
        description="A request aborted by a weight push (schedule.pause_mode: abort) continues under the new weights "
        "from the tokens it had, instead of its sample being dropped (no effect with pause_mode in_place or retract, "
        "which keep in-flight requests anyway, nor under the sync schedule, which pushes with nothing in flight). "
        "Whatever this flag, every response id records the version it was generated under (Sample.token_versions) "
        "and train.grpo.staleness weighs each token by its own age.",
    )
    overlong_penalty: OverlongPenaltyConfig | None = Field(
        None, description="Penalise responses near max_new_tokens in the reward (None: off)."
    )

    @model_validator(mode="after")
    def _plugins_have_their_settings(self) -> RolloutConfig:
        if self.generate == "multi_turn" and not self.environment:
            raise ValueError("generate: multi_turn needs rollout.environment (a dotted path to a factory)")
        if not isinstance(self.environment, str | None):
            if self.generate != "multi_turn":
                raise ValueError(
                    f"environment: a {self.environment.type} environment runs episodes: set rollout.generate: "
                    f"multi_turn (it is {self.generate!r})"
                )
            if "reward" not in self.model_fields_set:  # the environment's own rewards (its rubric, its steps)
                object.__setattr__(self, "reward", "env")
            if self.environment_args:
                raise ValueError(
                    f"environment_args: a {self.environment.type} environment takes its arguments in "
                    "rollout.environment (args, action_args, reset_args)"
                )
        if self.reward == "remote" and self.remote_reward is None:
            raise ValueError("reward: remote needs rollout.remote_reward (at least its url)")
        if self.reward == "judge" and self.judge is None:
            raise ValueError("reward: judge needs rollout.judge (at least its model and template)")
        if self.dynamic_sampling is not None and self.num_samples_per_prompt < 2:
            raise ValueError("dynamic_sampling: needs num_samples_per_prompt ≥ 2 (a group of one never varies)")
        if self.overlong_penalty is not None and self.generate == "multi_turn":
            raise ValueError(
                "overlong_penalty: measures a single-turn response against sampling.max_new_tokens; an episode's "
                "response holds several turns and the environment's tokens (multi_turn.max_total_tokens bounds it)"
            )
        if self.overlong_penalty is not None and self.overlong_penalty.buffer > self.sampling.max_new_tokens:
            raise ValueError(
                f"overlong_penalty.buffer: {self.overlong_penalty.buffer} is more than sampling.max_new_tokens "
                f"({self.sampling.max_new_tokens})"
            )
        return self


def check_revision(value: str) -> str:
    """A Hub revision as git names refs (a branch, tag, `refs/pr/1`, or a commit): no `..`, no leading or trailing
    `/`, none of the characters git refuses. The cache keeps a revision as a file name under the repository's folder,
    so a revision that is a path (`../x`) would read elsewhere; raise for it."""
    import re

    if (
        not re.fullmatch(r"[A-Za-z0-9._/-]{1,255}", value)
        or ".." in value
        or "//" in value
        or value.startswith(("/", ".", "-"))
        or value.endswith(("/", ".", ".lock"))
    ):
        raise ValueError(f"{value!r} is not a revision (a branch, tag or commit, like 'main' or 'refs/pr/1')")
    return value


class DataConfig(_Strict):
    """Prompts from a JSONL or Parquet file, from any dataset the `datasets` library reads (`source: hf`), or from
    the built-in arithmetic generator."""

    source: Literal["file", "hf", "arithmetic", "environment"] = Field(
        "arithmetic",
        description="file, hf, arithmetic, or environment: the dataset a verifiers environment brings (its train "
        "rows, and its eval rows or the last num_eval of them as held out).",
    )
    path: str | None = Field(
        None,
        description="source=file: a JSONL or Parquet file. source=hf: a Hub dataset id (`org/name`, through the "
        "Hugging Face cache), a local dataset folder (as on the Hub, or `save_to_disk`'s), or Parquet / JSONL / CSV "
        "/ Arrow files (globs allowed, e.g. `data/train-*.parquet`).",
    )
    eval_path: str | None = Field(None, description="Held-out prompts when source=file.")
    split: str = Field("train", description="source=hf: the split trained on (files given by path are `train`).")
    eval_split: str | None = Field(
        None, description="source=hf: a split of held-out prompts; None: eval_fraction, or the last num_eval rows."
    )
    eval_fraction: float | None = Field(
        None, gt=0, lt=1, description="source=hf: hold out this share of `split` (a seeded shuffle) for evaluation."
    )
    revision: str | None = Field(None, description="source=hf, a Hub id: a branch, tag or commit.")

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str | None) -> str | None:
        return None if value is None else check_revision(value)

    map: str | None = Field(
        None,
        description="source=hf: a function by dotted path (`module:function`) applied to every row (a dict) before "
        "prompt_key and label_key are read; it returns the row (changed or new columns), through `Dataset.map`.",
    )
    prompt_key: str = Field("prompt", description="Key of the prompt: a text, or a list of {role, content} messages.")
    label_key: str = "label"
    image_key: str | None = Field(
        None,
        description="Key of a prompt's images, for a vision-language model (e.g. `images`; None: the data has none, "
        "and every column is metadata): a path (relative to the data file), the bytes of an image file or a "
        "datasets Image, one or a list per prompt; a row without the key has none. They open the first user turn, "
        "rendered by the model's processor (data.chat_template: model or a file).",
    )
    chat_template: str = Field(
        "none",
        description="none: prompts are encoded as plain text; model: rendered with the tokenizer's chat template "
        "(a text prompt is one user turn), as an Instruct model expects; or a path to a Jinja template file. A "
        "template writes every special token itself (a BOS included): none is added to what it renders.",
    )
    system_prompt: str | None = Field(
        None, description="Opens every conversation (unless its messages bring one); needs a chat_template."
    )
    seed: int = 0
    num_train: int = Field(20000, gt=0, description="arithmetic: number of training prompts.")
    num_eval: int = Field(500, gt=0, description="arithmetic: number of held-out prompts.")
    digits: int = Field(2, ge=1, le=6, description="arithmetic: digits per operand.")
    operations: list[Operation] = Field(default_factory=lambda: list[Operation](["+"]))

    @model_validator(mode="after")
    def _fields_fit_source(self) -> DataConfig:
        if self.source not in ("arithmetic", "environment") and not self.path:
            raise ValueError(f"data.path: required when data.source is {self.source!r}")
        hf_only = {"eval_split": None, "eval_fraction": None, "revision": None, "map": None, "split": "train"}
        if self.source != "hf":
            given = [k for k, default in hf_only.items() if getattr(self, k) != default]
            if given:
                raise ValueError(f"data.{given[0]}: only for data.source hf (this is {self.source!r})")
        if self.eval_split is not None and self.eval_fraction is not None:
            raise ValueError("data.eval_split and data.eval_fraction: give one of them")
        return self

    @model_validator(mode="after")
    def _system_prompt_needs_template(self) -> DataConfig:
        if self.system_prompt is not None and self.chat_template == "none":
            raise ValueError("system_prompt needs a chat_template (model, or a Jinja file) to be rendered")
        if not self.chat_template:
            raise ValueError("chat_template: none, model, or the path of a Jinja file")
        return self
