"""The calculator tool-use task: the tool reads only arithmetic, the environment's rules, and warm-start
demonstrations whose ids and mask are exactly an episode's."""

import asyncio
from types import SimpleNamespace

import pytest

from miles_rollout.config import RolloutConfig
from miles_rollout.env import Action, ToolCall, parse_tool_call
from miles_rollout.generate import make_context, multi_turn
from miles_rollout.prompts import PromptEncoder
from miles_rollout.tasks.arithmetic import build_char_tokenizer
from miles_rollout.tasks.calculator import (
    CALL_TOKENS,
    Calculator,
    calculate,
    calculator_demonstrations,
    tool_use_records,
)
from miles_rollout.types import FinishReason, GenerateResult, PromptRecord, SamplingParams


def action(text: str) -> Action:
    return Action(text, parse_tool_call(text, "xml"))


@pytest.mark.parametrize(("expression", "value"), [("37*58", 2146), ("12+7", 19), ("5-9", -4), (" 3*4 ", 12)])
def test_calculate(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression", ["", "37*", "2**10", "__import__('os')", "1+2+3", "1234567*2", "3/4"])
def test_calculate_refuses_what_is_not_one_operation(expression):
    with pytest.raises(ValueError, match="the calculator reads a\\+b, a-b or a\\*b"):
        calculate(expression)


def test_an_answer_without_a_call_ends_the_episode():
    env = Calculator()
    env.reset(PromptRecord("37*58=", "2146"))
    assert env.step(action("2146")).reward == 1.0
    env.reset(PromptRecord("37*58=", "2146"))
    result = env.step(action("2246"))
    assert (result.reward, result.done, result.observation) == (0.0, True, None)


def test_a_call_gets_the_tools_answer_then_the_answer_is_scored():
    env = Calculator()
    env.reset(PromptRecord("37*58=", "2146"))
    called = env.step(action("<call>37*58</call>"))
    assert (called.observation, called.reward, called.done) == ("2146=", 0.0, False)
    assert env.step(action("2146")).reward == 1.0
    env.reset(PromptRecord("37*58=", "2146"))  # a call of the wrong numbers gets their value: the answer is wrong
    assert env.step(action("<call>37*85</call>")).observation == "3145="
    assert env.step(action("3145")).reward == 0.0


def test_calls_the_tool_cannot_read_or_too_many_end_the_episode():
    env = Calculator()
    env.reset(PromptRecord("37*58=", "2146"))
    bad = env.step(action("<call>37x58</call>"))
    assert (bad.reward, bad.done) == (0.0, True) and "not '37x58'" in bad.info["error"]
    env = Calculator(max_calls=1)
    env.reset(PromptRecord("37*58=", "2146"))
    env.step(action("<call>37*58</call>"))
    again = env.step(action("<call>37*58</call>"))
    assert (again.reward, again.done) == (0.0, True) and "more than 1 calls" in again.info["error"]
    env.reset(PromptRecord("37*58=", "2146"))  # a call to another tool (hermes names its tools)
    other = env.step(Action('<tool_call>{"name": "search"}</tool_call>', ToolCall("search", {"input": "37*58"})))
    assert (other.reward, other.done) == (0.0, True) and "no tool 'search'" in other.info["error"]
    with pytest.raises(ValueError, match="max_calls: -1"):
        Calculator(max_calls=-1)


def test_call_tokens_are_single_tokens_that_decoding_keeps():
    tokenizer = build_char_tokenizer(added_tokens=CALL_TOKENS)
    ids = tokenizer.encode("<call>37*58</call>")
    assert len(ids) == 7 and ids[0] == len(tokenizer) - 2 and ids[-1] == len(tokenizer) - 1
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == "<call>37*58</call>"


class ScriptedClient:
    """An engine client that writes the given model turns (ids), in order, and records what it was given."""

    engine = SimpleNamespace(weight_version=0)

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.inputs = list(turns), []

    async def generate(self, ids, sampling, request_id=""):
        self.inputs.append(list(ids))
        out = self.turns.pop(0)
        return GenerateResult(request_id, out, [0.0] * len(out), FinishReason.STOP, [0])


def test_demonstrations_are_what_the_episode_runner_makes_of_the_same_turns():
    """The warm start's demonstration of a call is, id for id and mask for mask, the sample generate.multi_turn
    builds when the model writes those turns against Calculator."""
    tokenizer = build_char_tokenizer(added_tokens=CALL_TOKENS)
    eos = tokenizer.eos_token_id
    record = PromptRecord("37*58=", "2146")
    ((prompt, completion, mask),) = calculator_demonstrations([record], tokenizer.encode, eos, {"*": 1.0}, seed=0)
    call_end = completion.index(eos) + 1
    answer_start = mask.index(1, call_end)  # after the tool's turn
    config = RolloutConfig.model_validate({
        "generate": "multi_turn", "environment": "miles_rollout.tasks.calculator:Calculator", "reward": "env",
        "multi_turn": {"max_turns": 2, "max_total_tokens": 32, "tool_format": "xml"},
    })  # fmt: skip
    ctx = make_context(config, tokenizer, PromptEncoder(tokenizer))
    client = ScriptedClient([completion[:call_end], completion[answer_start:]])
    sample = asyncio.run(multi_turn(record, client, SamplingParams(max_new_tokens=8), ctx))
    assert (sample.prompt_ids, sample.response_ids, sample.loss_mask) == (prompt, completion, mask)
    assert sample.metadata["episode"]["env_reward"] == 1.0 and sample.metadata["episode"]["end_reason"] == "done"
    assert client.inputs[1] == prompt + completion[:answer_start]  # the model answers after the tool's turn


def test_demonstrations_are_episodes_token_for_token():
    tokenizer = build_char_tokenizer(added_tokens=CALL_TOKENS)
    eos = tokenizer.eos_token_id
    records = [PromptRecord(f"{a}*{b}=", str(a * b)) for a, b in [(37, 58), (12, 11), (99, 99), (10, 45)]]
    records += [PromptRecord(f"{a}+{b}=", str(a + b)) for a, b in [(37, 58), (12, 11)]]
    examples = calculator_demonstrations(records, tokenizer.encode, eos, {"*": 1.0, "+": 0.0}, seed=0)
    for record, (prompt, completion, mask) in zip(records, examples, strict=True):
        assert prompt == tokenizer.encode(record.prompt) and len(mask) == len(completion)
        if "+" in record.prompt:  # share 0: the answer at once, all trained
            assert completion == tokenizer.encode(record.label) + [eos] and set(mask) == {1}
            continue
        # What Calculator and the episode runner make of a call: the model's turn (ending on its end token), the
        # tool's observation encoded once (masked out), the model's answer.
        env = Calculator()
        env.reset(record)
        turn = tokenizer.encode(f"<call>{record.prompt[:-1]}</call>") + [eos]
        observation = env.step(action(tokenizer.decode(turn, skip_special_tokens=True))).observation
        tool = tokenizer.encode(observation)
        assert completion == turn + tool + tokenizer.encode(record.label) + [eos]
        assert mask == [1] * len(turn) + [0] * len(tool) + [1] * (len(record.label) + 1)
    shares = calculator_demonstrations(records * 100, tokenizer.encode, eos, {"*": 0.25}, seed=1)
    calls = sum(0 in mask for _, _, mask in shares)
    assert 60 < calls < 140  # about a quarter of the 400 multiplications, none of the additions
    with pytest.raises(ValueError, match="'7/2=' is not"):
        calculator_demonstrations([PromptRecord("7/2=", "3.5")], tokenizer.encode, eos, {}, seed=0)


def test_tool_use_records_show_the_call_and_the_tools_answer():
    (record,) = tool_use_records([PromptRecord("37*58=", "2146")], "<eos>")
    assert record == PromptRecord("37*58=<call>37*58</call><eos>2146=", "2146")
