"""`rollout.reward: judge`: a judge model scores each response (`rollout.judge`).

The judge is served by an engine of its own in the rollout process (`rollout.judge.engine`: the in-process hf engine,
or SGLang servers of its own), built on first use from `rollout.judge.model` (a model folder, or `policy`: a frozen
copy of the job's starting model). Weight pushes go to the policy's engines only: the judge's never change. A step's
samples are judged together (every prompt sent at once: the engine batches them), greedily, with `max_new_tokens`.

Each sample's judge prompt is `template` filled with the record's question, its reference (the label) and the
response; with `chat_template` it is one user turn of the judge tokenizer's template. The verdict is parsed:

- `score`: the first number in the output, clipped to [score_min, score_max] and scaled to [0, 1];
- `choice`: the first of `choices` the output writes as a whole word (case-insensitive), worth its value.

A verdict that does not parse gets `default` and is counted: `reward/judge_unparsed` is the share of a step's
samples, and the verdict text is kept in `metadata["judge"]`. The judge's time is its own stage (`judge`, in place of
`reward`) in the per-stage timing.
"""

from __future__ import annotations

import asyncio
import atexit
import re
import threading
from pathlib import Path
from typing import Any

from miles_rollout.config import HFEngineConfig, JudgeConfig, SGLangEngineConfig
from miles_rollout.types import Sample, SamplingParams

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def engine_config(config: JudgeConfig) -> HFEngineConfig | SGLangEngineConfig:
    """The judge's engine: the named engine's default settings."""
    return HFEngineConfig() if config.engine == "hf" else SGLangEngineConfig(type="sglang")


def parse_verdict(text: str, config: JudgeConfig) -> float | None:
    """The reward a verdict gives, or None when it does not parse."""
    if config.verdict == "score":
        match = _NUMBER.search(text)
        if match is None:
            return None
        value = min(max(float(match.group()), config.score_min), config.score_max)
        return (value - config.score_min) / (config.score_max - config.score_min)
    best: tuple[int, float] | None = None
    for word, reward in config.choices.items():
        found = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE)
        if found is not None and (best is None or found.start() < best[0]):
            best = (found.start(), reward)
    return None if best is None else best[1]


class JudgeReward:
    """A batched, async reward function over a judge model's engine (built on first use)."""

    batched = True
    stage = "judge"  # the manager times it as its own stage

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self.policy_path: Path | None = None
        self.seed = 0
        self._engine: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def attach(self, model_path: Path, seed: int = 0) -> None:
        """The job's starting model (what `model: policy` judges with) and seed; the rollout worker calls it."""
        self.policy_path, self.seed = Path(model_path), seed

    def model_path(self) -> Path:
        if self.config.model == "policy":
            if self.policy_path is None:
                raise ValueError("rollout.judge.model: policy needs the job's model (the rollout worker attaches it)")
            return self.policy_path
        return Path(self.config.model)

    def _start(self) -> None:
        from transformers import AutoTokenizer

        from miles_rollout.engines import build_engine

        path = self.model_path()
        self._tokenizer = AutoTokenizer.from_pretrained(str(path))
        self._engine = build_engine(engine_config(self.config), path, seed=self.seed)
        atexit.register(self.shutdown)

    def shutdown(self) -> None:
        """Stop the judge's engine (its servers, for SGLang); the rollout worker's shutdown calls it."""
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()

    def prompt_ids(self, sample: Sample) -> list[int]:
        text = self.config.template.format(question=sample.prompt, reference=sample.label, answer=sample.response_text)
        tokenizer = self._tokenizer
        if self.config.chat_template and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return list(tokenizer.encode(text, add_special_tokens=False))
        return list(tokenizer.encode(text))

    async def __call__(self, samples: list[Sample]) -> list[float]:
        if self._engine is None:
            with self._lock:  # once, at the first step: the judge's engine loads
                if self._engine is None:
                    self._start()
        from miles_rollout.engine_client import EngineClient

        client = EngineClient(self._engine)
        sampling = SamplingParams(temperature=0.0, max_new_tokens=self.config.max_new_tokens)
        results = await asyncio.gather(
            *[client.generate(self.prompt_ids(s), sampling, request_id=f"judge-{i}") for i, s in enumerate(samples)]
        )
        rewards = []
        for sample, result in zip(samples, results, strict=True):
            text = self._tokenizer.decode(result.output_ids, skip_special_tokens=True)
            value = parse_verdict(text, self.config)
            sample.metadata["judge"] = {"verdict": text[:200], "parsed": value is not None}
            rewards.append(self.config.default if value is None else value)
        return rewards


def judge_metrics(samples: list[Sample]) -> dict[str, float]:
    """`reward/judge_unparsed`: the share of a step's judged samples whose verdict did not parse."""
    judged = [s.metadata["judge"] for s in samples if isinstance(s.metadata.get("judge"), dict)]
    if not judged:
        return {}
    return {"reward/judge_unparsed": sum(not j["parsed"] for j in judged) / len(judged)}
