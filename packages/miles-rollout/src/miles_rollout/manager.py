"""RolloutManager: prompts in, a scored `RolloutBatch` out."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import replace

from miles_rollout.config import RolloutConfig, SamplingConfig
from miles_rollout.engine_client import EngineClient
from miles_rollout.episode import check_sample
from miles_rollout.generate import BUILTIN, make_context, resolve_generate
from miles_rollout.prompts import PromptEncoder
from miles_rollout.protocol import RolloutEngine, call_limit
from miles_rollout.rewards import resolve_reward, score_all
from miles_rollout.types import (
    PromptRecord,
    RolloutBatch,
    Sample,
    SampleStatus,
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
        self.reward_fn = resolve_reward(config.reward, config.remote_reward, config.code_sandbox, config.judge)
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
        self,
        prompts: list[PromptRecord],
        num_samples_per_prompt: int | None = None,
        temperature: float | None = None,
        evaluating: bool = False,
    ) -> RolloutBatch:
        """`num_samples_per_prompt` samples per prompt from the generate function (`rollout.generate`), all
        concurrently through one `EngineClient` (calls made together reach the engine as one batch), then scored.
        `evaluating`: the model answers, whatever the generate function (`supervised` would return the labels)."""
        n = self.config.num_samples_per_prompt if num_samples_per_prompt is None else num_samples_per_prompt
        sampling = self.sampling_params(self.config.sampling, temperature)
        client = EngineClient(self.engine, self.vocab_size, continue_aborted=self.config.partial_rollouts)
        start = time.time()
        calls = [
            self._sample(record, client, sampling, g, k, evaluating) for g, record in enumerate(prompts) for k in range(n)
        ]  # fmt: skip
        samples = [s for group in await asyncio.gather(*calls) for s in group]
        generated = time.time()
        num_tokens = sum(len(s.response_ids) for s in samples)
        await self._score(samples, evaluating)
        scored = time.time()
        batch = RolloutBatch(
            samples,
            timings=[
                StageTiming("rollout", start, generated, num_tokens),
                StageTiming(getattr(self.reward_fn, "stage", "reward"), generated, scored),  # a judge: its own
            ],
            sampling=sampling,
        )
        if self.config.partial_rollouts:
            batch.metrics["rollout/partial_continued"] = float(client.num_continued)
        return batch

    async def _score(self, samples: list[Sample], evaluating: bool = False) -> None:
        """The reward of each sample, less the overlong penalty where it is on (training only: a held-out answer
        is scored as it is)."""
        for sample, reward in zip(samples, await score_all(self.reward_fn, samples, self.config.reward), strict=True):
            sample.reward = reward - (0.0 if evaluating else self._overlong(sample))

    def _overlong(self, sample: Sample) -> float:
        """DAPO's soft overlong punishment of `rollout.overlong_penalty` (0 when off or short enough)."""
        penalty = self.config.overlong_penalty
        if penalty is None:
            return 0.0
        limit = self.config.sampling.max_new_tokens
        over = len(sample.response_ids) - (limit - penalty.buffer)
        return penalty.factor * min(max(over, 0) / penalty.buffer, 1.0)

    async def generate_step(
        self, draw: Callable[[int], list[PromptRecord]], num_groups: int
    ) -> tuple[RolloutBatch, list[PromptRecord]]:
        """One step's `num_groups` groups and their prompts (group i of the batch is prompt i), prompts taken from
        `draw(n)`. Without `rollout.dynamic_sampling`: `generate(draw(num_groups))`. With it: groups are generated
        and scored as they finish; those whose rewards all agree are dropped; more prompts are launched while the
        step can still come up short (`oversample` × the groups missing, at most `max_rounds` launches); the requests
        still running once the step is full are aborted in the engine. `batch.metrics` counts what happened."""
        ds = self.config.dynamic_sampling
        if ds is None:
            prompts = draw(num_groups)
            batch = await self.generate(prompts)
            batch.metrics["rollout/prompts_drawn"] = float(len(prompts))
            return batch, prompts
        n = self.config.num_samples_per_prompt
        sampling = self.sampling_params(self.config.sampling)
        # an engine that batches concurrent calls itself (SGLang) answers each request when it is done; one that
        # decodes a batch at a time (hf) gets batches, and what waits behind a running one is what an abort saves
        concurrent = call_limit(self.engine) is None
        client = EngineClient(
            self.engine, self.vocab_size, batch_calls=not concurrent, continue_aborted=self.config.partial_rollouts
        )
        start = time.time()
        kept: list[tuple[PromptRecord, list[Sample]]] = []
        dropped: list[tuple[PromptRecord, list[Sample]]] = []
        running: dict[asyncio.Future, PromptRecord] = {}
        launches = drawn = finished_samples = surplus_done = generated_tokens = 0
        try:
            while len(kept) < num_groups:
                # A round is launched once the one before has drained (DAPO's generate, filter, repeat): topping up
                # as each group is dropped would spend the rounds on one or two prompts each where requests finish
                # one by one (SGLang).
                missing = num_groups - len(kept)
                if not running and launches < ds.max_rounds:
                    for record in draw(math.ceil(missing * ds.oversample)):
                        task = asyncio.ensure_future(self._scored_group(record, client, sampling, drawn, n))
                        running[task], drawn = record, drawn + 1
                    launches += 1
                if not running:
                    break  # every launch is spent: the step is padded below
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for finished in done:
                    record, samples = running.pop(finished), finished.result()
                    finished_samples += len(samples)
                    generated_tokens += sum(len(s.response_ids) for s in samples)
                    scored = [s for s in samples if s.status != SampleStatus.ABORTED]
                    if len({s.reward for s in scored}) <= 1:  # all agree (or none was scored): no signal
                        dropped.append((record, samples))
                    elif len(kept) < num_groups:
                        kept.append((record, samples))
                    else:
                        surplus_done += 1  # informative, but finished together with the step's last group
        finally:
            surplus = len(running)
            if running:
                await client.abort_outstanding()
                for ended in await asyncio.gather(*running, return_exceptions=True):  # they end at once, aborted
                    if isinstance(ended, list):
                        generated_tokens += sum(len(s.response_ids) for s in ended)
        padding = dropped[: num_groups - len(kept)]
        chosen = kept + padding
        samples = []
        for index, (_, group_samples) in enumerate(chosen):
            for sample in group_samples:
                sample.group_index = index
                samples.append(sample)
        end = time.time()  # the rollout span counts every token generated, the dropped and aborted groups' too
        batch = RolloutBatch(samples, timings=[StageTiming("rollout", start, end, generated_tokens)], sampling=sampling)
        batch.metrics.update(
            {
                "rollout/prompts_drawn": float(drawn),
                "rollout/ds_dropped_groups": float(len(dropped) - len(padding)),
                "rollout/ds_padded_groups": float(len(padding)),
                "rollout/ds_launches": float(launches),
                "rollout/ds_generated_samples": float(finished_samples),
                "rollout/ds_used_samples": float(len(samples)),
                "rollout/ds_surplus_groups": float(surplus + surplus_done),  # generated (or begun) for nothing
                "rollout/ds_aborted_requests": float(client.num_aborted),
                "rollout/ds_generated_tokens": float(generated_tokens),
            }
        )
        if self.config.partial_rollouts:
            batch.metrics["rollout/partial_continued"] = float(client.num_continued)
        return batch, [record for record, _ in chosen]

    async def _scored_group(
        self, record: PromptRecord, client: EngineClient, sampling: SamplingParams, group: int, n: int
    ) -> list[Sample]:
        """The `n` samples of one prompt, scored (an aborted sample keeps reward 0 and its ABORTED status)."""
        parts = await asyncio.gather(*(self._sample(record, client, sampling, group, k) for k in range(n)))
        samples = [s for part in parts for s in part]
        finished = [s for s in samples if s.status != SampleStatus.ABORTED]  # an aborted sample has no reward
        if finished and not client.closed:  # a surplus group, ended by the abort, is not scored
            await self._score(finished)
        return samples

    async def _sample(
        self,
        record: PromptRecord,
        client: EngineClient,
        sampling: SamplingParams,
        group: int,
        index: int,
        evaluating: bool = False,
    ) -> list[Sample]:
        ctx = replace(self.context, group_index=group, sample_index=index)
        generate_fn = (
            BUILTIN["single_turn"] if evaluating and self.config.generate == "supervised" else self.generate_fn
        )
        out = await generate_fn(record, client, sampling, ctx)
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
        batch = await self.generate(prompts, num_samples_per_prompt=1, temperature=temperature, evaluating=True)
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
