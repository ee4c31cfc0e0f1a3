"""The `rollout.engine` section, one model per engine type (`HFEngineConfig`, `SGLangEngineConfig`), each answering
the job's placement and memory questions itself. Imports only pydantic, so a job spec validates without torch;
`miles_rollout.config` composes it into `RolloutConfig`."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal

from pydantic import Field

from miles_sync.config import SpecModel


class _Strict(SpecModel):
    """A section of the job spec: unknown fields, inf/NaN and booleans for numbers are refused (miles_sync.config)."""


def _flag(extra_args: list[str], flags: tuple[str, ...], default: int) -> int:
    for i, arg in enumerate(extra_args):
        for flag in flags:
            if arg == flag and i + 1 < len(extra_args):
                return int(extra_args[i + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return default


def tp_size(extra_args: list[str]) -> int:
    """Tensor-parallel ranks of an SGLang server, from `--tp-size N` / `--tp N` among its extra flags."""
    return _flag(extra_args, ("--tp-size", "--tp"), 1)


def gpus_per_server(extra_args: list[str]) -> int:
    """GPUs one SGLang server uses: `--tp-size` × `--dp-size` (data-parallel replicas inside the server)."""
    return tp_size(extra_args) * _flag(extra_args, ("--dp-size", "--dp"), 1)


class HFEngineConfig(_Strict):
    """In-process transformers engine: batched sampling with a KV cache."""

    type: Literal["hf"] = "hf"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: the checkpoint's dtype (config.json)."
    )
    max_batch_size: int = Field(1024, gt=0, description="Sequences decoded together in one forward pass.")
    num_threads: int | None = Field(None, gt=0, description="torch threads for this engine; None keeps torch's.")
    routed_experts: bool = Field(
        False,
        description="A mixture of experts: every sample carries the experts each token was routed to (read from "
        "transformers' routers as it decodes), for train.routing_replay and train/routing_agreement.",
    )

    # What the job's planner and checks ask an engine config (SGLangEngineConfig answers the same questions).

    @property
    def num_engines(self) -> int:
        """Engines the rollout worker runs: this one, in its own process."""
        return 1

    def gpus_per_engine(self, requested: int | Literal["auto"], has_gpus: bool) -> int:
        """GPUs each engine holds under `resources.rollout_gpus_per_engine: requested`: none, it runs on CPU."""
        return 0

    def gpus_problem(self, gpus: int) -> str | None:
        """Why an engine cannot hold `gpus` GPUs (an explicit count); None when it can."""
        return None if gpus == 0 else "the hf engine runs on CPU; use 0 (or auto)"

    @property
    def releases_memory(self) -> bool:
        """Whether the engines give their GPU memory back while a colocated trainer steps: it holds none."""
        return False

    def colocated_problem(self, world_size: int) -> str | None:
        """Why the engines cannot take the GPUs of `world_size` trainer ranks; None: it takes no GPUs (and is refused
        for colocation by `releases_memory`)."""
        return None

    def as_colocated(self) -> HFEngineConfig:
        """This config as a colocated job runs it: unchanged."""
        return self

    def packed_weights_refusal(self) -> str | None:
        """The setting that keeps the engine from loading packed low-precision weights (`sync.quant_wire: packed`)."""
        return "rollout.engine.type: hf"

    def adapter_delta_refusal(self) -> str | None:
        """Why a LoRA adapter pushed by itself (`sync.lora: adapter`) cannot travel as a delta (`sync.delta`); None:
        the engine merges the changed matrices into the adapter it holds."""
        return None

    def with_log_dir(self, log_dir: str) -> HFEngineConfig:
        """This config with its servers logging under `log_dir` where it names no folder: it has no servers."""
        return self


class SGLangEngineConfig(_Strict):
    """SGLang HTTP servers: launched and supervised here, or attached to by URL."""

    type: Literal["sglang"]
    urls: list[str] = Field(default_factory=list, description="Attach to running servers instead of launching.")
    num_engines: int = Field(1, gt=0, description="Servers to launch when `urls` is empty.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto: the checkpoint's dtype (config.json; SGLang's own auto would run fp32 checkpoints in "
        "half precision). A bf16 engine sees only weight changes larger than half a bf16 step: with a small "
        "learning rate, fp32 engines receive more of each update (docs/real-models.md).",
    )
    max_total_tokens: int = Field(65536, gt=0, description="KV-cache size per server, in tokens.")
    startup_timeout_s: float = Field(180.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    extra_args: list[str] = Field(default_factory=list, description="More `sglang.launch_server` flags.")
    routed_experts: bool = Field(
        False,
        description="A mixture of experts: every sample carries the experts each token was routed to (the servers "
        "start with --enable-return-routed-experts), for train.routing_replay and train/routing_agreement.",
    )
    log_dir: str | None = Field(None, description="Server logs; a temporary folder when None.")
    max_requests_per_call: int = Field(
        64, gt=0, description="Requests per /generate call; each call goes to the server with the fewest in flight."
    )
    health_interval_s: float = Field(5.0, gt=0, description="Seconds between /health_generate probes of each server.")
    health_timeout_s: float = Field(20.0, gt=0, description="A probe slower than this quarantines the server.")
    max_restarts: int = Field(3, ge=0, description="Restarts of a crashed server before giving up on it.")
    verify_weights: bool = Field(
        True,
        description="After every weight load, compare each server's per-tensor checksums (/weights_checker) with "
        "the published tensors: bit-exact, costs a hash of the weights on both sides.",
    )

    # What the job's planner and checks ask an engine config (HFEngineConfig answers the same questions).

    @property
    def gpus_per_server(self) -> int:
        """GPUs one server uses: `--tp-size` × `--dp-size` among its extra flags."""
        return gpus_per_server(self.extra_args)

    def gpus_per_engine(self, requested: int | Literal["auto"], has_gpus: bool) -> int:
        """GPUs each server holds under `resources.rollout_gpus_per_engine: requested` (auto: `gpus_per_server` on a
        cluster with GPUs); none for servers attached by URL or launched on CPU."""
        if self.urls or self.device == "cpu":
            return 0
        if requested == "auto":
            return self.gpus_per_server if has_gpus else 0
        return int(requested)

    def gpus_problem(self, gpus: int) -> str | None:
        """Why a server cannot hold `gpus` GPUs (an explicit count, 0 for CPU); None when it can."""
        if gpus and gpus != self.gpus_per_server:
            return (
                f"{gpus} is not what each SGLang server uses: --tp-size × --dp-size in rollout.engine.extra_args = "
                f"{self.gpus_per_server}"
            )
        return None

    @property
    def releases_memory(self) -> bool:
        """Whether the engines give their GPU memory back while a colocated trainer steps: SGLang's servers do
        (`/release_memory_occupation`, with `as_colocated`'s memory saver)."""
        return True

    def colocated_problem(self, world_size: int) -> str | None:
        """Why the launched servers cannot take the GPUs of `world_size` trainer ranks, one each; None when they can
        (or are attached by URL)."""
        if self.urls or self.num_engines * self.gpus_per_server == world_size:
            return None
        return (
            f"{self.num_engines} engine(s) × {self.gpus_per_server} GPU(s) must equal train.backend.world_size "
            f"({world_size}, one GPU per rank)"
        )

    def as_colocated(self) -> SGLangEngineConfig:
        """This config as a colocated job runs it: SGLang frees and retakes its GPU memory around each train step
        only with its memory saver on (`--enable-memory-saver`)."""
        if "--enable-memory-saver" in self.extra_args:
            return self
        return self.model_copy(update={"extra_args": [*self.extra_args, "--enable-memory-saver"]})

    def packed_weights_refusal(self) -> str | None:
        """The setting that keeps the engine from loading packed low-precision weights (`sync.quant_wire: packed`):
        SGLang's kernels for them need a GPU."""
        return "rollout.engine.device: cpu" if self.device == "cpu" else None

    def adapter_delta_refusal(self) -> str | None:
        """Why a LoRA adapter pushed by itself (`sync.lora: adapter`) cannot travel as a delta (`sync.delta`): SGLang
        loads an adapter whole (and every matrix of it moves at each step)."""
        return "SGLang loads an adapter whole (and every matrix of it moves at each step)"

    def with_log_dir(self, log_dir: str) -> SGLangEngineConfig:
        """This config with its servers logging under `log_dir` where it names no folder (else a temporary one)."""
        return self if self.log_dir is not None else self.model_copy(update={"log_dir": log_dir})


EngineConfig = Annotated[HFEngineConfig | SGLangEngineConfig, Field(discriminator="type")]


def default_engine() -> HFEngineConfig | SGLangEngineConfig:
    """SGLang where it is installed, else the in-process transformers engine."""
    if importlib.util.find_spec("sglang") is not None:
        return SGLangEngineConfig(type="sglang")
    return HFEngineConfig()
