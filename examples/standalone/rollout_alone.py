"""miles-rollout alone, from your own script (no Ray, no miles-train, no miles-control): draw groups of
samples from an HF model folder with the in-process engine, score them with your own reward, and take the
token ids and per-token logprobs to any trainer.

    pip install packages/miles-sync packages/miles-rollout
    python rollout_alone.py MODEL_DIR

`rollout.engine.type: sglang` (pip install 'miles-rollout[sglang]') swaps in SGLang servers with no other
change; `engine.receive(handle)` loads new weights published by a miles-sync sender.
"""

from __future__ import annotations

import asyncio
import sys

from transformers import AutoTokenizer

from miles_rollout import HFEngineConfig, PromptRecord, RolloutConfig, RolloutManager, build_engine


def longer_is_better(sample) -> float:
    """A reward is any function of a `Sample` returning a number (or a registered name: `exact_match`)."""
    return float(len(sample.response_ids))


def main(model_dir: str) -> None:
    engine_config = HFEngineConfig(dtype="float32")
    config = RolloutConfig(
        engine=engine_config,
        num_samples_per_prompt=4,
        sampling={"temperature": 0.8, "max_new_tokens": 8},
        reward=f"{__name__}:longer_is_better",  # a dotted path; this script's own module here
    )
    engine = build_engine(engine_config, model_dir, seed=0)
    try:
        manager = RolloutManager(engine, AutoTokenizer.from_pretrained(model_dir), config)
        prompts = [PromptRecord("12+30=", "42"), PromptRecord("7+5=", "12")]
        batch = asyncio.run(manager.generate(prompts))
    finally:
        engine.shutdown()
    print(f"sampled at temperature {batch.sampling.temperature} under weight version {engine.weight_version}")
    for s in batch.samples:
        print(
            f"group {s.group_index}: {len(s.response_ids)} tokens, reward {s.reward:.0f}, "
            f"sum logprob {sum(s.rollout_logprobs):.3f}, status {s.status.value}"
        )
    print(f"samples: {len(batch.samples)} in {batch.num_groups} groups")


if __name__ == "__main__":
    main(sys.argv[1])
