"""Multi-turn episodes from engine to trainer, on SGLang and on the hf engine (issue 19's parity check).

Episodes of up to three model turns with a plug-in environment answer every turn: the trainer's input ids
(`to_train_batch`) are the prompt ids followed by the engine's and the environment's ids in order; the loss mask is
zero exactly on the environment's; the trainer's logprobs (`miles_train.collate.token_logprobs`, fp32) of the
model's tokens equal the engine's within the fp32 parity bound of each engine.
"""

import asyncio
import importlib.util
import sys
import types

import pytest
import torch

from miles_rollout.env import StepResult

BOUNDS = {"hf": 1e-5, "sglang": 1e-4}  # max |Δ logprob| per model token, fp32 on both sides
ENGINES = ["hf", "sglang"]


class Echo:
    """Every model turn is answered with "+N=" (N: the step); done after three steps."""

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, record):
        return None

    def step(self, action):
        self.steps += 1
        done = self.steps == 3
        return StepResult(None if done else f"+{self.steps}=", reward=float(action.text == "3"), done=done)


@pytest.mark.slow
@pytest.mark.parametrize("engine_type", ENGINES)
def test_episode_ids_mask_and_logprobs_reach_the_trainer(engine_type, tmp_path, monkeypatch):
    if engine_type == "sglang":
        if importlib.util.find_spec("sglang") is None:
            pytest.skip("SGLang is not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_control.job.assets import build_builtin_model
    from miles_control.job.convert import to_train_batch
    from miles_control.spec.config import BuiltinModelConfig
    from miles_rollout import HFEngineConfig, PromptRecord, RolloutConfig, RolloutManager, build_engine
    from miles_rollout.config import MultiTurnConfig, SamplingConfig, SGLangEngineConfig
    from miles_rollout.tasks.arithmetic import arithmetic_prompts
    from miles_train.collate import collate, token_logprobs

    module = types.ModuleType("multi_turn_envs")
    module.Echo = Echo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "multi_turn_envs", module)
    model_dir = build_builtin_model(BuiltinModelConfig())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine_config = (
        HFEngineConfig(dtype="float32")
        if engine_type == "hf"
        else SGLangEngineConfig(type="sglang", dtype="float32", log_dir=str(tmp_path))
    )
    config = RolloutConfig(
        num_samples_per_prompt=2,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=6, stop=list("0123456789")),
        generate="multi_turn",
        environment="multi_turn_envs:Echo",
        reward="env",
        multi_turn=MultiTurnConfig(max_turns=3, max_total_tokens=48),
    )
    engine = build_engine(engine_config, model_dir, seed=2)
    try:
        manager = RolloutManager(engine, tokenizer, config, vocab_size=len(tokenizer))
        prompts = [PromptRecord(r.prompt, r.label) for r in arithmetic_prompts(8, seed=4)]
        batch = asyncio.run(manager.generate(prompts))
    finally:
        engine.shutdown()
    train = to_train_batch(batch)
    ends = [s.metadata["episode"]["end_reason"] for s in batch.samples]
    assert ends.count("done") >= 4, ends  # most episodes have three model turns and two environment turns
    for sample, ids, start, mask in zip(batch.samples, train.input_ids, train.response_start, train.loss_mask,
                                        strict=True):  # fmt: skip
        env = [m["content"] for m in sample.metadata["episode"]["messages"] if m["role"] != "assistant"]
        env_ids = [tokenizer.encode(text, add_special_tokens=False) for text in env]
        assert ids[:start] == tokenizer.encode(sample.prompt)
        # the response: model ids (mask 1), then each environment turn's ids (mask 0), in order
        position = start
        for turn in env_ids:
            model_ids = mask[position - start :].index(0)
            position += model_ids
            assert ids[position : position + len(turn)] == turn
            assert mask[position - start : position - start + len(turn)] == [0] * len(turn)
            position += len(turn)
        assert 0 not in mask[position - start :] and sum(1 - m for m in mask) == sum(map(len, env_ids))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    c = collate(train)
    with torch.no_grad():
        trainer, _ = token_logprobs(model, c, temperature=train.temperature)
    diff = (trainer - c.rollout_logprobs).abs()[c.loss_mask.bool()]
    print(f"{engine_type} multi-turn vs trainer: max |Δ logprob| {diff.max():.2e} over {diff.numel()} model tokens")
    assert diff.numel() == sum(map(sum, train.loss_mask)) and diff.max().item() < BOUNDS[engine_type]
