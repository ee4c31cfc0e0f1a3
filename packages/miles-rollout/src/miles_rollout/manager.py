"""RolloutManager: prompts in, a scored `RolloutBatch` out."""

from __future__ import annotations

import time

from miles_rollout.config import RolloutConfig, SamplingConfig
from miles_rollout.prompts import PromptEncoder
from miles_rollout.protocol import RolloutEngine
from miles_rollout.rewards import resolve_reward, score
from miles_rollout.types import (
    GenerateRequest,
    PromptRecord,
    RolloutBatch,
    Sample,
    SamplingParams,
    StageTiming,
    status_of,
)


class RolloutManager:
    """Draws `num_samples_per_prompt` responses per prompt from an engine and scores them.

    The tokenizer is used only at the edges: prompts are encoded once (by `encoder`: plain text, or a chat
    template), responses decoded for the reward function; the ids the engine produced are what the trainer
    receives.
    """

    def __init__(
        self, engine: RolloutEngine, tokenizer, config: RolloutConfig, encoder: PromptEncoder | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.encoder = encoder or PromptEncoder(tokenizer)
        self.config = config
        self.reward_fn = resolve_reward(config.reward)
        self._stop_token_ids = self._stop_ids(config.sampling.stop)

    def _stop_ids(self, stop: list[str]) -> tuple[int, ...]:
        ids = []
        for text in stop:
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(
                    f"rollout.sampling.stop: {text!r} is {len(encoded)} tokens; stop strings must be one token"
                )
            ids.append(encoded[0])
        return tuple(ids)

    def sampling_params(self, sampling: SamplingConfig, temperature: float | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=sampling.temperature if temperature is None else temperature,
            top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens,
            stop_token_ids=self._stop_token_ids,
            ignore_eos=sampling.ignore_eos,
        )

    async def generate(
        self, prompts: list[PromptRecord], num_samples_per_prompt: int | None = None, temperature: float | None = None
    ) -> RolloutBatch:
        n = self.config.num_samples_per_prompt if num_samples_per_prompt is None else num_samples_per_prompt
        sampling = self.sampling_params(self.config.sampling, temperature)
        prompt_ids = [self.encoder.encode(p) for p in prompts]
        requests = [
            GenerateRequest(ids, sampling, request_id=f"{g}-{k}") for g, ids in enumerate(prompt_ids) for k in range(n)
        ]
        start = time.time()
        results = await self.engine.generate(requests)
        generated = time.time()
        samples = []
        for request, result in zip(requests, results, strict=True):
            group = int(request.request_id.split("-")[0])
            record = prompts[group]
            samples.append(
                Sample(
                    group_index=group,
                    prompt=record.prompt,
                    label=record.label,
                    prompt_ids=request.input_ids,
                    response_ids=result.output_ids,
                    rollout_logprobs=result.output_logprobs,
                    loss_mask=[1] * len(result.output_ids),
                    response_text=self.tokenizer.decode(result.output_ids, skip_special_tokens=True),
                    status=status_of(result.finish_reason),
                    weight_versions=result.weight_versions,
                    metadata=dict(record.metadata),
                )
            )
        num_tokens = sum(len(s.response_ids) for s in samples)
        for sample in samples:
            sample.reward = score(self.reward_fn, sample, self.config.reward)
        scored = time.time()
        return RolloutBatch(
            samples,
            timings=[
                StageTiming("rollout", start, generated, num_tokens),
                StageTiming("reward", generated, scored),
            ],
            sampling=sampling,
        )

    async def evaluate(self, prompts: list[PromptRecord], temperature: float = 0.0) -> dict[str, float]:
        """One response per prompt; accuracy is the mean reward (exact match gives 0 or 1)."""
        batch = await self.generate(prompts, num_samples_per_prompt=1, temperature=temperature)
        rewards = batch.rewards()
        return {
            "eval/accuracy": sum(rewards) / len(rewards),
            "eval/response_length": batch.num_response_tokens / len(rewards),
        }
