"""The data contract of the rollout side: requests, results, samples and batches."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks, tests)

    @property
    def greedy(self) -> bool:
        """Temperature 0: the most likely token, every time."""
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution whose logprobs the engines report, and the trainer recomputes:
        the sampling temperature, or 1 when greedy (the model's own distribution). The one definition of the
        greedy convention: the hf engine and `to_train_batch` read it."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class GenerateRequest:
    """Token-in: the engine sees ids, never text."""

    input_ids: list[int]
    sampling: SamplingParams
    request_id: str = ""
    # a prompt with images: the model processor's tensors for them (`pixel_values`, `image_grid_thw`) and
    # `mm_token_type_ids`, one entry per prompt id (1 where an id stands for image features); None for text
    multimodal: dict[str, Any] | None = None


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # aborted by a pause(mode="abort")


@dataclass
class GenerateResult:
    request_id: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    weight_versions: list[int]  # every version the request was generated under
    token_versions: list[int] = field(default_factory=list)  # the version each output id was generated under
    # a mixture of experts, when the engine returns it: the experts each position of prompt + output (less the last
    # id) was routed to, an int tensor [positions, layers × top_k]
    routed_experts: Any = None

    def versions_per_token(self) -> list[int]:
        """`token_versions` when the engine gave one per output id, else its first version for every id (an
        engine that reports versions per request only)."""
        if len(self.token_versions) == len(self.output_ids):
            return list(self.token_versions)
        return [self.weight_versions[0] if self.weight_versions else 0] * len(self.output_ids)


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


_STATUS_OF = {
    FinishReason.STOP: SampleStatus.COMPLETED,
    FinishReason.LENGTH: SampleStatus.TRUNCATED,
    FinishReason.ABORT: SampleStatus.ABORTED,
}


def status_of(reason: FinishReason) -> SampleStatus:
    return _STATUS_OF[reason]


@dataclass
class PromptRecord:
    """One prompt of a task. `prompt` is its text (for a conversation, the last user turn's); `messages`, when
    the data gives a conversation (`[{"role": ..., "content": ...}, ...]`), is rendered with the chat template;
    `images`, for a vision-language model, are rendered with it by the model's processor."""

    prompt: str
    label: str
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None
    # the prompt's images, as the bytes of image files (PNG, JPEG...), checked readable when the data was loaded;
    # the model's processor places them before the text of the first user turn
    images: list[bytes] = field(default_factory=list)


@dataclass
class Sample:
    """One response to one prompt, carried unchanged from engine to trainer."""

    group_index: int  # samples of the same prompt share it
    prompt: str
    label: str
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]
    response_text: str = ""
    reward: float = 0.0
    status: SampleStatus = SampleStatus.COMPLETED
    weight_versions: list[int] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    # the weight version each response id was generated under (environment ids: the turn's before them); empty
    # when the generate function did not say, and then every id counts as `oldest_weight_version`
    token_versions: list[int] = field(default_factory=list)
    # the engine's expert routing of prompt + response (GenerateResult.routed_experts): what train.routing_replay
    # replays; None when the engine gave none
    routed_experts: Any = None
    # a prompt with images: what the engine was given for them (GenerateRequest.multimodal), which the trainer's
    # forward takes too; None for text
    multimodal: dict[str, Any] | None = None
    # the prompt's images as the data gave them (PromptRecord.images), for people to look at (the dashboard)
    images: list[bytes] = field(default_factory=list)

    @property
    def oldest_weight_version(self) -> int:
        return min(self.weight_versions)

    def staleness(self, trainer_version: int) -> int:
        """How many versions the trainer is ahead of the oldest weights this sample was generated under: the one
        definition of staleness (schedules, the fully_async buffer and the trainer's weighting use it)."""
        return trainer_version - self.oldest_weight_version


@dataclass
class StageTiming:
    stage: str
    start: float  # time.time()
    end: float
    num_tokens: int = 0


@dataclass
class RolloutBatch:
    """Samples of one or more prompts, how they were sampled (the trainer needs the temperature to recompute
    their logprobs) and the timings of the stages that made them."""

    samples: list[Sample]
    timings: list[StageTiming] = field(default_factory=list)
    sampling: SamplingParams | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # what making it counted (dynamic sampling's drops)

    @property
    def num_groups(self) -> int:
        return len({s.group_index for s in self.samples})

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)

    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]
