import asyncio

import pytest
from transformers import AutoTokenizer

from miles_rollout import HFEngineConfig, PromptRecord, RolloutConfig, RolloutManager, SampleStatus, build_engine
from miles_rollout.config import SamplingConfig


@pytest.fixture(scope="module")
def manager_parts(tiny_model_dir):
    return build_engine(HFEngineConfig(), tiny_model_dir, seed=1), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_groups_of_n_samples_are_scored(manager_parts):
    engine, tokenizer = manager_parts
    config = RolloutConfig(
        num_samples_per_prompt=4, sampling=SamplingConfig(max_new_tokens=4), reward="miles_rollout.rewards:exact_match"
    )
    manager = RolloutManager(engine, tokenizer, config)
    prompts = [PromptRecord("12+30=", "42"), PromptRecord("5+5=", "10")]
    batch = asyncio.run(manager.generate(prompts))
    assert len(batch.samples) == 8 and batch.num_groups == 2
    for s in batch.samples:
        assert s.prompt_ids == tokenizer.encode(s.prompt)
        assert s.prompt == prompts[s.group_index].prompt
        assert len(s.rollout_logprobs) == len(s.response_ids) == len(s.loss_mask)
        assert s.reward == float(s.response_text.strip() == s.label)
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert s.weight_versions == [0]
    assert [t.stage for t in batch.timings] == ["rollout", "reward"]


def test_custom_reward_by_dotted_path(manager_parts):
    engine, tokenizer = manager_parts
    config = RolloutConfig(num_samples_per_prompt=2, reward="tests_rewards_helper:length_reward")
    import sys
    import types

    module = types.ModuleType("tests_rewards_helper")
    module.length_reward = lambda sample: float(len(sample.response_ids))
    sys.modules["tests_rewards_helper"] = module
    try:
        batch = asyncio.run(RolloutManager(engine, tokenizer, config).generate([PromptRecord("1+1=", "2")]))
    finally:
        del sys.modules["tests_rewards_helper"]
    assert [s.reward for s in batch.samples] == [float(len(s.response_ids)) for s in batch.samples]


def test_multi_token_stop_string_is_refused(manager_parts):
    engine, tokenizer = manager_parts
    with pytest.raises(ValueError, match="rollout.sampling.stop: '12' is 2 tokens"):
        RolloutManager(engine, tokenizer, RolloutConfig(sampling=SamplingConfig(stop=["12"])))


def test_evaluate_reports_accuracy(manager_parts):
    engine, tokenizer = manager_parts
    manager = RolloutManager(engine, tokenizer, RolloutConfig(reward="tests_always_one:reward"))
    import sys
    import types

    module = types.ModuleType("tests_always_one")
    module.reward = lambda sample: 1.0
    sys.modules["tests_always_one"] = module
    try:
        metrics = asyncio.run(manager.evaluate([PromptRecord("1+1=", "2")] * 3))
    finally:
        del sys.modules["tests_always_one"]
    assert metrics["eval/accuracy"] == 1.0
