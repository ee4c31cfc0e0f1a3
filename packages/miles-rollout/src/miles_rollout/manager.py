"""RolloutManager: prompts in, a scored `RolloutBatch` out."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from miles_rollout.client import EngineClient
from miles_rollout.config import RolloutConfig, SamplingConfig
from miles_rollout.episode import check_sample
from miles_rollout.generate import BUILTIN, make_context, resolve_generate
from miles_rollout.prompts import PromptEncoder
from miles_rollout.protocol import RolloutEngine
from miles_rollout.rewards import resolve_reward, score_all
from miles_rollout.types import (
    PromptRecord,
    RolloutBatch,
    Sample,
    SamplingParams,
    StageTiming,
)


class RolloutManager:
    """Draws `num_samples_per_prompt` samples per prompt through the generate function and scores them.

    The tokenizer is used only at the edges: prompts are encoded once (by `encoder`: plain text, or a chat
    template), responses decoded for the reward function; the ids the engine produced (and, in episodes, the
    environment's turns tokenized once) are what the trainer receives. `vocab_size`: the model's (config.json);
    ids at or above it are refused before they reach the engine or the trainer (None: only negative ones).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        config: RolloutConfig,
        encoder: PromptEncoder | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.encoder = encoder or PromptEncoder(tokenizer)
        self.config = config
        self.reward_fn = resolve_reward(config.reward, config.remote_reward)
        self.generate_fn = resolve_generate(config.generate)
        self.vocab_size = vocab_size
        self.context = make_context(config, tokenizer, self.encoder)
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
        """`num_samples_per_prompt` samples per prompt from the generate function (`rollout.generate`), all
        concurrently through one `EngineClient` (calls made together reach the engine as one batch), then scored."""
        n = self.config.num_samples_per_prompt if num_samples_per_prompt is None else num_samples_per_prompt
        sampling = self.sampling_params(self.config.sampling, temperature)
        client = EngineClient(self.engine, self.vocab_size)
        start = time.time()
        calls = [
            self._sample(record, client, sampling, g, k) for g, record in enumerate(prompts) for k in range(n)
        ]  # fmt: skip
        samples = [s for group in await asyncio.gather(*calls) for s in group]
        generated = time.time()
        num_tokens = sum(len(s.response_ids) for s in samples)
        for sample, reward in zip(samples, await score_all(self.reward_fn, samples, self.config.reward), strict=True):
            sample.reward = reward
        scored = time.time()
        return RolloutBatch(
            samples,
            timings=[
                StageTiming("rollout", start, generated, num_tokens),
                StageTiming("reward", generated, scored),
            ],
            sampling=sampling,
        )

    async def _sample(
        self, record: PromptRecord, client: EngineClient, sampling: SamplingParams, group: int, index: int
    ) -> list[Sample]:
        ctx = replace(self.context, group_index=group, sample_index=index)
        out = await self.generate_fn(record, client, sampling, ctx)
        where = f"rollout.generate {self.config.generate!r}"
        samples = out if isinstance(out, list) else [out]
        if not samples:
            raise ValueError(f"{where} returned no sample for {record.prompt[:60]!r}")
        for sample in samples:
            if self.config.generate not in BUILTIN:  # the built-in ones lay samples out themselves (episode.py)
                check_sample(sample, self.vocab_size, where)
            sample.group_index = group  # the group is the manager's: samples of one record are compared together
        return samples

    async def evaluate(self, prompts: list[PromptRecord], temperature: float = 0.0) -> dict[str, float]:
        """One response (or episode) per prompt; accuracy is the mean reward (exact match gives 0 or 1). Episodes
        add `eval/success` (the share with a positive reward) and `eval/num_turns`."""
        batch = await self.generate(prompts, num_samples_per_prompt=1, temperature=temperature)
        rewards = batch.rewards()
        out = {
            "eval/accuracy": sum(rewards) / len(rewards),
            "eval/response_length": batch.num_response_tokens / len(rewards),
        }
        episodes = [s.metadata.get("episode") for s in batch.samples]
        if episodes and all(isinstance(e, dict) for e in episodes):
            out["eval/success"] = sum(r > 0 for r in rewards) / len(rewards)
            out["eval/num_turns"] = sum(e["num_turns"] for e in episodes) / len(episodes)  # type: ignore[index]
        return out
