"""A verifiers environment's episodes on the hf engine through Miles' verifiers client: token-faithful ids, the
limits of rollout.multi_turn mapped to Miles' end reasons, an environment that raises ending its episode only, and
an unscored episode leaving its rubric metrics unmeasured."""

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from miles_control.testing.tiny_models import save_tiny_model, tiny_model
from miles_rollout import HFEngineConfig, PromptRecord, RolloutConfig, RolloutManager, build_engine
from miles_rollout.config import MultiTurnConfig, SamplingConfig, VerifiersEnvironment
from miles_rollout.hubs.verifiers_env import verifiers_metrics
from miles_rollout.prompts import PromptEncoder
from miles_rollout.tasks.arithmetic import build_char_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_episodes import DIGITS, TEMPLATE, TURN_TOKENS, trained_view  # noqa: E402

pytest.importorskip("verifiers", reason="PyPI verifiers is not installed (pip install 'miles-rollout[hubs]')")

ENV_MODULE = '''
import verifiers as vf
from datasets import Dataset


class Counter(vf.MultiTurnEnv):
    """Answers model turn N with the user turn "+N="; its env_response raises at turn 2 when told to."""

    def __init__(self, fail=False, **kwargs):
        super().__init__(max_turns=50, **kwargs)
        self.fail = fail

    async def env_response(self, messages, state, **kwargs):
        n = len(state["trajectory"])
        if self.fail and n == 2:
            raise ZeroDivisionError("tool: division by zero")
        return [{"role": "user", "content": f"+{n}="}]


def turns(state) -> float:
    return float(len(state["trajectory"]))


def load_environment(fail=False):
    data = Dataset.from_list([{"question": "1+2=", "answer": "3"}] * 4)
    return Counter(fail=fail, dataset=data, rubric=vf.Rubric(funcs=[turns], weights=[1.0]))
'''


@pytest.fixture(scope="module")
def chat_parts(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": TURN_TOKENS})
    tokenizer.chat_template = TEMPLATE
    config = tiny_model("qwen2", tokenizer=tokenizer, max_position_embeddings=512)
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-chat-vf"), config, tokenizer=tokenizer)
    return folder, build_engine(HFEngineConfig(), folder, seed=5), AutoTokenizer.from_pretrained(folder)


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "miles_test_vf_counter.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "miles_test_vf_counter"


def run(chat_parts, module: str, args: dict | None = None, **multi_turn):
    folder, engine, tokenizer = chat_parts
    config = RolloutConfig(
        num_samples_per_prompt=2,
        sampling=SamplingConfig(max_new_tokens=6, stop=DIGITS),  # every digit ends a turn, as in test_episodes
        generate="multi_turn",
        environment=VerifiersEnvironment(type="verifiers", id=module, args=args or {}),
        multi_turn=MultiTurnConfig(**{"max_turns": 3, "max_total_tokens": 200, **multi_turn}),
    )
    manager = RolloutManager(engine, tokenizer, config, PromptEncoder(tokenizer, "model"), vocab_size=len(tokenizer))
    record = PromptRecord("1+2=", "3", {"verifiers": {"example_id": 0}}, [{"role": "user", "content": "1+2="}])
    return asyncio.run(manager.generate([record])).samples


def test_episodes_keep_the_engines_ids_and_end_at_mileses_max_turns(chat_parts, env_module):
    folder, _, tokenizer = chat_parts
    samples = run(chat_parts, env_module)
    assert len(samples) == 2
    for sample in samples:
        episode = sample.metadata["episode"]
        assert episode["end_reason"] == "max_turns" and episode["num_turns"] == 3, episode
        assert sample.reward == 3.0 and sample.metadata["verifiers"]["metrics"]["turns"] == 3.0
        # the environment's turns are in the ids as the template renders them after a model turn, masked out
        env_text = tokenizer.decode([i for i, m in zip(sample.response_ids, sample.loss_mask, strict=True) if not m])
        assert "+1=" in env_text and "+2=" in env_text and "+3=" not in env_text, env_text
        assert sample.loss_mask[-1] == 1  # ends on the model's turn
        # the trainer's view of the ids (one forward over prompt + response) gives the engine's logprobs
        trained = trained_view(folder, sample, 1.0)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        engine = torch.tensor(sample.rollout_logprobs)
        assert torch.allclose(trained[mask], engine[mask], atol=1e-5)
    assert verifiers_metrics(samples) == {"reward/vf_turns": 3.0, "reward/vf_num_turns": 3.0}  # + its monitor


def test_max_total_tokens_ends_the_episode_on_a_model_turn(chat_parts, env_module):
    samples = run(chat_parts, env_module, max_total_tokens=14, max_turns=8)
    for sample in samples:
        assert len(sample.prompt_ids) + len(sample.response_ids) <= 14
        assert sample.metadata["episode"]["end_reason"] in ("max_tokens", "length"), sample.metadata["episode"]
        assert sample.loss_mask[-1] == 1  # an environment turn no model turn answers is dropped
        assert sample.metadata["episode"]["messages"][-1]["role"] == "assistant"


def test_an_environment_that_raises_ends_its_episode_only_and_is_not_scored(chat_parts, env_module):
    samples = run(chat_parts, env_module, args={"fail": True})
    for sample in samples:
        episode = sample.metadata["episode"]
        assert episode["end_reason"] == "env_error" and "ZeroDivisionError" in episode["error"], episode
        assert episode["num_turns"] == 2
        assert "verifiers" not in sample.metadata  # unscored: no rubric metric is reported for it
    assert verifiers_metrics(samples) == {}
