import asyncio
import sys
import types

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
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert s.weight_versions == [0]
    assert [t.stage for t in batch.timings] == ["rollout", "reward"]
    assert batch.sampling is not None and batch.sampling.max_new_tokens == 4  # how the batch was sampled


def test_exact_match_scores_through_the_manager(manager_parts):
    """Greedy decoding is deterministic: a label equal to the model's answer scores 1, another scores 0."""
    engine, tokenizer = manager_parts
    config = RolloutConfig(
        num_samples_per_prompt=2, sampling=SamplingConfig(temperature=0.0, max_new_tokens=4), reward="exact_match"
    )
    manager = RolloutManager(engine, tokenizer, config)
    first = asyncio.run(manager.generate([PromptRecord("12+30=", "?")]))
    answer = first.samples[0].response_text.strip()
    assert answer and all(s.response_text.strip() == answer for s in first.samples)  # greedy: the same answer
    batch = asyncio.run(manager.generate([PromptRecord("12+30=", answer), PromptRecord("12+30=", answer + "0")]))
    assert [s.reward for s in batch.samples] == [1.0, 1.0, 0.0, 0.0]


def plugin_module(monkeypatch, name: str, **attrs) -> None:
    """A user module importable by dotted path, as an installed plug-in package would be."""
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


def test_custom_reward_by_dotted_path(manager_parts, monkeypatch):
    engine, tokenizer = manager_parts
    plugin_module(monkeypatch, "user_rewards", length_reward=lambda sample: float(len(sample.response_ids)))
    config = RolloutConfig(num_samples_per_prompt=2, reward="user_rewards:length_reward")
    batch = asyncio.run(RolloutManager(engine, tokenizer, config).generate([PromptRecord("1+1=", "2")]))
    assert [s.reward for s in batch.samples] == [float(len(s.response_ids)) for s in batch.samples]


def test_multi_token_stop_string_is_refused(manager_parts):
    engine, tokenizer = manager_parts
    with pytest.raises(ValueError, match="rollout.sampling.stop: '12' is 2 tokens"):
        RolloutManager(engine, tokenizer, RolloutConfig(sampling=SamplingConfig(stop=["12"])))


def test_evaluate_reports_accuracy(manager_parts, monkeypatch):
    engine, tokenizer = manager_parts
    plugin_module(monkeypatch, "user_rewards_half", reward=lambda sample: float(sample.prompt == "1+1="))
    manager = RolloutManager(engine, tokenizer, RolloutConfig(reward="user_rewards_half:reward"))
    metrics = asyncio.run(manager.evaluate([PromptRecord("1+1=", "2"), PromptRecord("2+2=", "4")]))
    assert metrics["eval/accuracy"] == 0.5
