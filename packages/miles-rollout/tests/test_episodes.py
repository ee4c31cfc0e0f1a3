"""Multi-turn episodes on the hf engine: token-faithful layout, environment failures, plug-in errors, batching."""

import asyncio
import sys
import time
import types

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from miles_control.testing.tiny_models import save_tiny_model, tiny_model
from miles_rollout import HFEngineConfig, PromptRecord, RolloutConfig, RolloutManager, build_engine
from miles_rollout.config import MultiTurnConfig, SamplingConfig
from miles_rollout.engine_client import EngineClient
from miles_rollout.env import StepResult, ToolCall, environment_factory, parse_tool_call
from miles_rollout.episode import Episode, check_sample
from miles_rollout.prompts import PromptEncoder
from miles_rollout.tasks.arithmetic import build_char_tokenizer
from miles_rollout.types import SampleStatus, SamplingParams

DIGITS = list("0123456789")
TURN_TOKENS = ["<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
# A template in the char alphabet: turns open with a role token and close with <|end|>, an assistant's with
# <|end|> and "=" (text after the token the model stops on, as ChatML's newline after <|im_end|>).
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% if m.role == 'assistant' %}={% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def plugin_module(monkeypatch, name: str, **attrs) -> None:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


class Counter:
    """Answers every model turn with a tool turn "+N=" (N: the turn number); done after `turns` steps."""

    def __init__(self, turns: int = 3, fail: str = "") -> None:
        self.turns, self.fail, self.seen = turns, fail, []

    def reset(self, record):
        return None

    async def step(self, action):
        self.seen.append(action)
        if self.fail == "raise" and len(self.seen) == 2:
            raise ZeroDivisionError("calculator: division by zero")
        if self.fail == "hang" and len(self.seen) == 2:
            await asyncio.sleep(30)
        if self.fail == "garbage" and len(self.seen) == 2:
            return StepResult(observation={"not": "text"})
        done = len(self.seen) >= self.turns
        return StepResult(observation=None if done else f"+{len(self.seen)}=", reward=1.0, done=done)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A random tiny Qwen2 whose char tokenizer has turn tokens and a chat template."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": TURN_TOKENS})
    tokenizer.chat_template = TEMPLATE
    config = tiny_model("qwen2", tokenizer=tokenizer, max_position_embeddings=512)
    return save_tiny_model(tmp_path_factory.mktemp("tiny-chat"), config, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    return build_engine(HFEngineConfig(), tiny_model_dir, seed=3), AutoTokenizer.from_pretrained(tiny_model_dir)


def episodes_config(env: str, **multi_turn) -> RolloutConfig:
    # Every digit stops a turn: the random model ends turns after a few tokens, as a trained one would.
    return RolloutConfig(
        num_samples_per_prompt=2,
        sampling=SamplingConfig(max_new_tokens=6, stop=DIGITS),
        generate="multi_turn",
        environment=env,
        reward="env",
        multi_turn=MultiTurnConfig(**{"max_turns": 4, "max_total_tokens": 200, **multi_turn}),
    )


def trained_view(model_dir, sample, temperature: float) -> torch.Tensor:
    """Logprobs of the response ids as a trainer computes them: one fp32 forward over prompt + response."""
    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(sample.prompt_ids) :, None]).squeeze(-1)


def test_episode_layout_masks_environment_tokens():
    episode = Episode([5, 6])
    episode.add_model([7, 8], [-0.5, -0.25], [0], "ab")
    episode.add_env([9, 9, 9], [{"role": "tool", "content": "xyz"}])
    episode.add_model([10], [-1.0], [1], "c")
    episode.rewards += [0.5, 0.25]
    episode.end("done")
    sample = episode.to_sample(PromptRecord("p", "l", {"k": 1}), group_index=3)
    assert sample.prompt_ids == [5, 6] and sample.response_ids == [7, 8, 9, 9, 9, 10]
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    assert sample.rollout_logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert sample.weight_versions == [0, 1] and sample.response_text == "c" and sample.group_index == 3
    assert sample.token_versions == [0, 0, 0, 0, 0, 1]  # environment ids: the version of the turn before them
    assert sample.metadata["k"] == 1 and sample.metadata["episode"]["env_reward"] == 0.75
    assert [m["role"] for m in sample.metadata["episode"]["messages"]] == ["assistant", "tool", "assistant"]
    with pytest.raises(ValueError, match="unknown end reason 'oops'"):
        episode.end("oops")


def test_an_episode_carries_the_routing_its_last_model_turn_read():
    """A mixture of experts: each model turn's routing covers every id it read and generated but its last; the
    last model turn read all before it, so its routing is the sample's (a later environment turn has none)."""
    episode = Episode([5, 6])
    episode.add_model([7, 8], [-0.5, -0.25], [0], "ab", routed_experts=torch.zeros(2 + 2 - 1, 4, dtype=torch.int16))
    episode.add_env([9, 9, 9], [{"role": "tool", "content": "xyz"}])
    last = torch.arange(7 * 4, dtype=torch.int16).view(7, 4)  # 2 prompt + 2 + 3 env ids read, 1 generated, less 1
    episode.add_model([10], [-1.0], [1], "c", routed_experts=last)
    episode.add_env([11], [{"role": "tool", "content": "w"}])
    episode.end("max_turns")
    assert torch.equal(episode.to_sample(PromptRecord("p", "l")).routed_experts, last)
    with pytest.raises(ValueError, match="routing covers 3 positions; it read 9 ids and generated 1, so 9"):
        episode.add_model([12], [-1.0], [1], "d", routed_experts=torch.zeros(3, 4, dtype=torch.int16))


def test_check_sample_names_the_function_and_value():
    episode = Episode([1, 2])
    episode.add_model([3, 4], [-0.1, -0.2], [0], "x")
    episode.end("done")
    good = episode.to_sample(PromptRecord("p", "l"))
    assert check_sample(good, 17, "rollout.generate 'my.mod:fn'") is good
    with pytest.raises(TypeError, match=r"'my.mod:fn' returned a dict, not a miles_rollout.Sample: \{'a': 1\}"):
        check_sample({"a": 1}, 17, "rollout.generate 'my.mod:fn'")
    bad = episode.to_sample(PromptRecord("p", "l"))
    bad.response_ids[1] = 99
    with pytest.raises(ValueError, match=r"'my.mod:fn': response_ids\[1\] is 99, outside the vocabulary \[0, 17\)"):
        check_sample(bad, 17, "rollout.generate 'my.mod:fn'")
    bad = episode.to_sample(PromptRecord("p", "l"))
    bad.loss_mask = [1]
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response ids"):
        check_sample(bad, 17, "fn")
    bad = episode.to_sample(PromptRecord("p", "l"))
    bad.rollout_logprobs[0] = float("nan")
    with pytest.raises(ValueError, match=r"rollout_logprobs\[0\] is nan"):
        check_sample(bad, 17, "fn")
    bad = episode.to_sample(PromptRecord("p", "l"))
    bad.token_versions = [0]
    with pytest.raises(ValueError, match="token_versions has 1 entries for 2 response ids"):
        check_sample(bad, 17, "fn")
    bad.token_versions = [0, 2]
    with pytest.raises(ValueError, match=r"token_versions holds \[2\], which weight_versions \[0\] does not"):
        check_sample(bad, 17, "fn")


def test_a_turn_continued_across_a_push_keeps_the_version_of_each_id():
    episode = Episode([1, 2])
    episode.add_model([3, 4, 5], [-0.1, -0.2, -0.3], [0, 1], "x", token_versions=[0, 0, 1])
    episode.add_env([6], [{"role": "tool", "content": "y"}])
    episode.add_model([7], [-0.4], [1], "z", token_versions=[1])
    episode.end("done")
    sample = check_sample(episode.to_sample(PromptRecord("p", "l")), 17, "fn")
    assert sample.token_versions == [0, 0, 1, 1, 1] and sample.weight_versions == [0, 1]


def test_tool_call_formats():
    text = 'let me compute <tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n</tool_call>'
    assert parse_tool_call(text, "hermes") == ToolCall("calc", {"expr": "2*3"})
    assert parse_tool_call('<tool_call>{"name": "calc", "arguments": "{\\"x\\": 1}"}</tool_call>', "hermes") == (
        ToolCall("calc", {"x": 1})
    )
    assert parse_tool_call("<tool_call>{not json</tool_call>", "hermes") is None
    assert parse_tool_call("no call", "hermes") is None
    assert parse_tool_call("12<call>3*4</call>", "xml") == ToolCall("call", {"input": "3*4"})
    assert parse_tool_call("<call>3*4</call>", "none") is None


def test_environment_factory_errors(monkeypatch):
    with pytest.raises(ValueError, match="cannot import module 'no_such_env_module'"):
        environment_factory("no_such_env_module:Env")
    plugin_module(monkeypatch, "user_envs", NotEnv=lambda: object(), Env=Counter)
    with pytest.raises(ValueError, match=r"'user_envs:NotEnv' made a object without reset\(\) and step\(\)"):
        environment_factory("user_envs:NotEnv")()
    with pytest.raises(ValueError, match=r"calling 'user_envs:Env' with \['colour'\] failed"):
        environment_factory("user_envs:Env", {"colour": 1})()
    assert environment_factory("user_envs:Env", {"turns": 2})().turns == 2


def test_client_batches_concurrent_calls(parts):
    engine, _ = parts
    client = EngineClient(engine, vocab_size=17)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3)

    async def run():
        return await asyncio.gather(*[client.generate([4 + i % 10, 5], sampling) for i in range(8)])

    results = asyncio.run(run())
    assert len(results) == 8 and all(len(r.output_ids) <= 3 for r in results)
    assert client.num_calls == 1  # eight callers, one engine batch

    async def bad():
        await client.generate([3, 17], sampling, request_id="r7")

    with pytest.raises(ValueError, match=r"request r7: input_ids\[1\] is 17, outside the vocabulary \[0, 17\)"):
        asyncio.run(bad())


def test_multi_turn_episodes_are_token_faithful(parts, tiny_model_dir, monkeypatch):
    """The trainer's input is the prompt, the engine's ids and the environment's ids, in order; the mask is 0
    exactly on the environment's; the trainer's logprobs of model tokens are the engine's."""
    engine, tokenizer = parts
    plugin_module(monkeypatch, "user_envs", Counter=Counter)
    manager = RolloutManager(engine, tokenizer, episodes_config("user_envs:Counter"), vocab_size=17)
    batch = asyncio.run(manager.generate([PromptRecord("12+3=", "15"), PromptRecord("4*5=", "20")]))
    assert len(batch.samples) == 4 and batch.num_groups == 2
    for sample in batch.samples:
        episode = sample.metadata["episode"]
        assert episode["end_reason"] in ("done", "length"), episode
        assert sample.prompt_ids == tokenizer.encode(sample.prompt)
        env_turns = [m["content"] for m in episode["messages"] if m["role"] != "assistant"]
        # rebuild the response from the transcript: model ids masked in, each tool turn's ids masked out
        position, rebuilt = 0, []
        for message in episode["messages"]:
            if message["role"] == "assistant":
                n = sample.loss_mask[position:].index(0) if 0 in sample.loss_mask[position:] else None
                ids = sample.response_ids[position : None if n is None else position + n]
                assert tokenizer.decode(ids, skip_special_tokens=True) == message["content"]
            else:
                ids = tokenizer.encode(message["content"], add_special_tokens=False)
                assert sample.response_ids[position : position + len(ids)] == ids
                assert set(sample.loss_mask[position : position + len(ids)]) == {0}
            rebuilt += ids
            position += len(ids)
        assert rebuilt == sample.response_ids
        if episode["end_reason"] == "done":
            assert episode["num_turns"] == 3 and len(env_turns) == 2 and sample.reward == 3.0
        assert all(lp == 0.0 for lp, m in zip(sample.rollout_logprobs, sample.loss_mask, strict=True) if not m)
        trainer = trained_view(tiny_model_dir, sample, batch.sampling.logprob_temperature)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        engine_lp = torch.tensor(sample.rollout_logprobs)
        assert (trainer - engine_lp)[mask].abs().max().item() < 1e-5
    assert any(s.metadata["episode"]["end_reason"] == "done" for s in batch.samples)


@pytest.mark.parametrize(
    ("fail", "reason", "error"),
    [
        ("raise", "env_error", "ZeroDivisionError: calculator: division by zero"),
        ("hang", "env_timeout", "step_timeout_s (0.5 s)"),
        ("garbage", "bad_observation", "{'not': 'text'}"),
    ],
)
def test_failing_environment_ends_its_episode_only(parts, monkeypatch, fail, reason, error):
    engine, tokenizer = parts
    plugin_module(monkeypatch, "user_envs", Counter=Counter)
    config = episodes_config("user_envs:Counter", step_timeout_s=0.5)
    config.environment_args = {"fail": fail}
    manager = RolloutManager(engine, tokenizer, config, vocab_size=17)
    start = time.monotonic()
    batch = asyncio.run(manager.generate([PromptRecord("1+2=", "3")]))
    assert time.monotonic() - start < 20  # a hanging step does not hold the batch (the limit is 0.5 s)
    for sample in batch.samples:
        episode = sample.metadata["episode"]
        if episode["end_reason"] == "length":  # the model ran out of tokens before the second step
            continue
        assert episode["end_reason"] == reason and error in episode["error"], episode
        assert episode["num_turns"] == 2 and sample.loss_mask.count(0) == 3  # "+1=" is not trained on
        assert sample.status == SampleStatus.COMPLETED  # env_failures: train (the default)
    assert any(s.metadata["episode"]["end_reason"] == reason for s in batch.samples)
    if fail == "raise":  # env_failures: drop leaves such episodes out of training, as aborted
        config.multi_turn.env_failures = "drop"
        batch = asyncio.run(
            RolloutManager(engine, tokenizer, config, vocab_size=17).generate([PromptRecord("1+2=", "3")])
        )
        for sample in batch.samples:
            failed = sample.metadata["episode"]["end_reason"] == reason
            assert (sample.status == SampleStatus.ABORTED) == failed, sample.metadata["episode"]
        assert any(s.status == SampleStatus.ABORTED for s in batch.samples)


class ThreadBound:
    """An environment holding what belongs to one thread (a sqlite connection, made in its constructor)."""

    def __init__(self) -> None:
        import sqlite3

        self.db = sqlite3.connect(":memory:")
        self.db.execute("create table turns (text)")

    def reset(self, record):
        self.db.execute("insert into turns values ('reset')")
        return None

    def step(self, action):
        self.db.execute("insert into turns values (?)", (action.text,))
        (count,) = self.db.execute("select count(*) from turns").fetchone()
        return StepResult(observation=None if count >= 3 else "+1=", reward=float(count), done=count >= 3)


def test_an_environment_runs_on_one_thread_per_episode(parts, monkeypatch):
    """Construction, reset and every step of an episode's (plain) environment run on the same thread: sqlite
    refuses a connection used from another thread, so this fails if any call moves."""
    engine, tokenizer = parts
    plugin_module(monkeypatch, "user_envs", ThreadBound=ThreadBound)
    manager = RolloutManager(engine, tokenizer, episodes_config("user_envs:ThreadBound"), vocab_size=17)
    batch = asyncio.run(manager.generate([PromptRecord("1+2=", "3"), PromptRecord("4+5=", "9")]))
    ends = [s.metadata["episode"] for s in batch.samples]
    assert all(e["end_reason"] in ("done", "length") for e in ends), ends
    assert any(e["end_reason"] == "done" and e["env_rewards"] == [2.0, 3.0] for e in ends), ends


def test_a_step_reward_that_is_not_a_number_names_the_environment(parts, monkeypatch):
    engine, tokenizer = parts
    bad = type("NoReward", (), {"reset": lambda self, r: None, "step": lambda self, a: StepResult(reward=None)})
    plugin_module(monkeypatch, "user_envs", NoReward=bad)
    manager = RolloutManager(engine, tokenizer, episodes_config("user_envs:NoReward"), vocab_size=17)
    with pytest.raises(TypeError, match=r"user_envs:NoReward: step\(\) returned reward=None: expected a number"):
        asyncio.run(manager.generate([PromptRecord("1+2=", "3")]))


def test_template_turns_append_what_the_template_renders(chat_model_dir):
    """With a chat template, prompt + model turn + environment turn are the ids of the whole conversation
    rendered by the template (the model's stop token and the template's closing text included)."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    encoder = PromptEncoder(tokenizer, "model")
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    prompt = encoder.encode(PromptRecord("3*4=", "12"))
    model_turn = tokenizer.encode("12", add_special_tokens=False) + [end]  # as generated: stopped on <|end|>
    env = encoder.turn_ids([{"role": "tool", "content": "12"}], model_end="<|end|>")
    whole = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "3*4="},
            {"role": "assistant", "content": "12"},
            {"role": "tool", "content": "12"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt + model_turn + env == tokenizer.encode(whole, add_special_tokens=False)
    assert tokenizer.decode(env) == "=<|tool|>12<|end|><|assistant|>"


def test_template_episodes_on_the_engine(chat_model_dir, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    engine = build_engine(HFEngineConfig(), chat_model_dir, seed=5)
    plugin_module(monkeypatch, "user_envs", Counter=Counter)
    config = episodes_config("user_envs:Counter")
    config.sampling = SamplingConfig(max_new_tokens=6, stop=["<|end|>", *DIGITS])
    manager = RolloutManager(engine, tokenizer, config, PromptEncoder(tokenizer, "model"), vocab_size=len(tokenizer))
    batch = asyncio.run(manager.generate([PromptRecord("2+2=", "4")]))
    encoder = manager.encoder
    for sample in batch.samples:
        runs: list[tuple[int, list[int]]] = []  # (mask, ids) of each turn
        for token, m in zip(sample.response_ids, sample.loss_mask, strict=True):
            if runs and runs[-1][0] == m:
                runs[-1][1].append(token)
            else:
                runs.append((m, [token]))
        env_messages = [m for m in sample.metadata["episode"]["messages"] if m["role"] != "assistant"]
        assert len(env_messages) == sum(1 - m for m, _ in runs) >= 1
        for k, (m, ids) in enumerate(runs):
            if not m:  # the template's closing of the model turn, the environment's turn, the next turn's opening
                expected = encoder.turn_ids([env_messages.pop(0)], model_end=tokenizer.decode(runs[k - 1][1][-1:]))
                assert ids == expected and tokenizer.decode(ids).endswith("<|end|><|assistant|>")
        trainer = trained_view(chat_model_dir, sample, batch.sampling.logprob_temperature)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        assert (trainer - torch.tensor(sample.rollout_logprobs))[mask].abs().max().item() < 1e-5


def test_generate_function_by_dotted_path(parts, monkeypatch):
    engine, tokenizer = parts

    async def two_tries(record, client, sampling, ctx):
        """A custom generate function: two independent completions of the prompt, both returned."""
        ids = ctx.encoder.encode(record)
        results = await asyncio.gather(*[client.generate(ids, sampling) for _ in range(2)])
        samples = []
        for r in results:
            episode = Episode(ids)
            episode.add_model(r.output_ids, r.output_logprobs, r.weight_versions, tokenizer.decode(r.output_ids))
            episode.end("done")
            samples.append(episode.to_sample(record))
        return samples

    async def wrong_type(record, client, sampling, ctx):
        return "a text"

    async def out_of_vocab(record, client, sampling, ctx):
        sample = await two_tries(record, client, sampling, ctx)
        sample[0].prompt_ids = [*sample[0].prompt_ids, 40]
        return sample[0]

    def not_async(record, client, sampling, ctx):
        return None

    plugin_module(monkeypatch, "user_gen", two_tries=two_tries, wrong_type=wrong_type, out_of_vocab=out_of_vocab,
                  not_async=not_async)  # fmt: skip
    config = RolloutConfig(num_samples_per_prompt=2, sampling=SamplingConfig(max_new_tokens=3))
    batch = asyncio.run(
        RolloutManager(engine, tokenizer, config.model_copy(update={"generate": "user_gen:two_tries"}), vocab_size=17)
        .generate([PromptRecord("1+1=", "2"), PromptRecord("2+2=", "4")])
    )  # fmt: skip
    assert len(batch.samples) == 8 and sorted(s.group_index for s in batch.samples) == [0] * 4 + [1] * 4
    for path, error, match in [
        (
            "user_gen:wrong_type",
            TypeError,
            r"'user_gen:wrong_type' returned a str, not a miles_rollout.Sample: 'a text'",
        ),
        ("user_gen:out_of_vocab", ValueError, r"'user_gen:out_of_vocab': prompt_ids\[4\] is 40, outside"),
    ]:
        manager = RolloutManager(engine, tokenizer, config.model_copy(update={"generate": path}), vocab_size=17)
        with pytest.raises(error, match=match):
            asyncio.run(manager.generate([PromptRecord("1+1=", "2")]))
    with pytest.raises(ValueError, match=r"'user_gen:not_async' is a function, not an async function"):
        RolloutManager(engine, tokenizer, config.model_copy(update={"generate": "user_gen:not_async"}))
    with pytest.raises(ValueError, match="rollout.generate: unknown 'three_turns'"):
        RolloutManager(engine, tokenizer, config.model_copy(update={"generate": "three_turns"}))


def test_multi_turn_needs_an_environment():
    with pytest.raises(ValueError, match="generate: multi_turn needs rollout.environment"):
        RolloutConfig(generate="multi_turn")


def test_max_total_tokens_ends_the_episode(parts, monkeypatch):
    engine, tokenizer = parts
    plugin_module(monkeypatch, "user_envs", Counter=Counter)
    config = episodes_config("user_envs:Counter", max_total_tokens=9, max_turns=8)
    config.environment_args = {"turns": 100}
    batch = asyncio.run(RolloutManager(engine, tokenizer, config, vocab_size=17).generate([PromptRecord("1+2=", "3")]))
    for sample in batch.samples:
        assert len(sample.prompt_ids) + len(sample.response_ids) <= 9
        assert sample.metadata["episode"]["end_reason"] in ("max_tokens", "length")
        assert sample.loss_mask[-1] == 1  # never ends on an environment turn no model turn answers
        assert sample.metadata["episode"]["messages"][-1]["role"] == "assistant"  # nor does the transcript
        episode = sample.metadata["episode"]  # a turn cut by the limit is still shown to the environment (scored)
        assert len(episode["env_rewards"]) == episode["num_turns"], episode


class Stalls:
    """A plain (not async) environment whose first step never comes back in time, or whose reset fails."""

    def __init__(self, fail: str = "step") -> None:
        self.fail = fail

    def reset(self, record):
        if self.fail == "reset":
            raise ConnectionError("sandbox down")

    def step(self, action):
        time.sleep(5)
        return StepResult(done=True)


def test_a_plain_step_that_hangs_holds_neither_the_rollout_nor_the_engine(parts, monkeypatch):
    engine, tokenizer = parts
    plugin_module(monkeypatch, "user_envs", Stalls=Stalls)
    config = episodes_config("user_envs:Stalls", step_timeout_s=0.3)
    config.sampling = SamplingConfig(max_new_tokens=3, stop=DIGITS + ["+", "-", "*", "="])  # every turn stops
    manager = RolloutManager(engine, tokenizer, config, vocab_size=17)
    start = time.monotonic()
    batch = asyncio.run(manager.generate([PromptRecord("1+2=", "3")] * 4))
    assert time.monotonic() - start < 4  # eight steps of 5 s each, cut at 0.3 s; asyncio.run waits for none
    reasons = [s.metadata["episode"]["end_reason"] for s in batch.samples]
    assert reasons.count("env_timeout") >= 4, reasons


def test_episodes_that_never_reach_the_model_are_aborted_not_fatal(parts, monkeypatch):
    """An environment that fails to start, or a prompt that fills max_total_tokens: that episode is aborted
    (left out of training, with the engine's version for staleness), the others go on."""
    engine, tokenizer = parts
    plugin_module(monkeypatch, "user_envs", Stalls=Stalls, Counter=Counter)
    config = episodes_config("user_envs:Stalls")
    config.environment_args = {"fail": "reset"}
    batch = asyncio.run(RolloutManager(engine, tokenizer, config, vocab_size=17).generate([PromptRecord("1+2=", "3")]))
    for sample in batch.samples:
        episode = sample.metadata["episode"]
        assert episode["end_reason"] == "env_error" and "ConnectionError: sandbox down" in episode["error"]
        assert sample.status == SampleStatus.ABORTED and sample.response_ids == []
        assert sample.weight_versions == [engine.weight_version] and sample.staleness(engine.weight_version) == 0
    config = episodes_config("user_envs:Counter", max_total_tokens=6)
    manager = RolloutManager(engine, tokenizer, config, vocab_size=17)
    batch = asyncio.run(manager.generate([PromptRecord("12+34=", "46"), PromptRecord("1+2=", "3")]))
    long, short = batch.samples[0], batch.samples[2]
    assert long.status == SampleStatus.ABORTED and "the prompt is 6 tokens" in long.metadata["episode"]["error"]
    assert short.response_ids and short.status != SampleStatus.ABORTED


def test_client_fails_every_caller_when_the_engine_miscounts(parts):
    class Miscounting:
        """A stand-in engine (a test double) that returns one result fewer than it was asked for."""

        name = "miscounting"
        max_concurrent_calls = None

        async def generate(self, requests):
            return (await engine.generate(requests))[:-1]

    engine, _ = parts
    client = EngineClient(Miscounting())  # type: ignore[arg-type]

    async def run():
        sampling = SamplingParams(max_new_tokens=2)
        return await asyncio.wait_for(
            asyncio.gather(*[client.generate([4, 5], sampling) for _ in range(3)], return_exceptions=True), 30
        )

    errors = asyncio.run(run())
    assert all(isinstance(e, RuntimeError) and "2 results for 3 requests" in str(e) for e in errors), errors


def test_templates_that_render_the_last_turn_differently(chat_model_dir):
    """Like Qwen3's (an empty think block on the last assistant turn only): the environment turn is what follows
    an assistant turn that is not the last."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' and loop.last %}**{% endif %}"
        "{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    encoder = PromptEncoder(tokenizer, "model")
    ids = encoder.turn_ids([{"role": "user", "content": "5"}], model_end="<|end|>")
    assert tokenizer.decode(ids) == "<|user|>5<|end|><|assistant|>"


TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %}{{ t | tojson }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class Multiplier:
    """A tool environment in the hermes format: `mul` multiplies its arguments; the answer after it ends."""

    tools = [{"type": "function", "function": {"name": "mul", "parameters": {"type": "object"}}}]

    def __init__(self) -> None:
        self.actions: list = []

    def reset(self, record):
        return None

    def step(self, action):
        self.actions.append(action)
        if action.tool_call is not None:
            return StepResult(observation=str(action.tool_call.arguments["a"] * action.tool_call.arguments["b"]))
        return StepResult(reward=float(action.text == "42"), done=True)


def test_a_tool_episode_is_the_templates_rendering_of_the_tools_the_call_and_the_tool_turn(monkeypatch):
    """Issue 19's "chat templates for episodes, with the tools list and the tool-call format": the environment's
    `tools` are rendered into the prompt by the template, the model's hermes call is parsed, the tool's answer is
    a `tool` turn, and the episode's ids are exactly the template's rendering of the whole conversation."""
    import string

    from miles_rollout.generate import make_context, multi_turn
    from miles_rollout.types import FinishReason, GenerateResult

    alphabet = "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")
    tokenizer = build_char_tokenizer(alphabet)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|system|>", *TURN_TOKENS]})
    tokenizer.chat_template = TOOLS_TEMPLATE
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    call = '<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>'
    turns = [tokenizer.encode(call, add_special_tokens=False) + [end], tokenizer.encode("42") + [end]]
    envs: list[Multiplier] = []
    plugin_module(monkeypatch, "user_tools", make=lambda: envs.append(Multiplier()) or envs[-1])

    class Scripted:
        engine = types.SimpleNamespace(weight_version=0)

        async def generate(self, ids, sampling, request_id=""):
            out = turns.pop(0)
            return GenerateResult(request_id, out, [-0.5] * len(out), FinishReason.STOP, [0])

    config = RolloutConfig(generate="multi_turn", environment="user_tools:make", reward="env",
                           multi_turn=MultiTurnConfig(max_turns=3, max_total_tokens=400, tool_format="hermes"))  # fmt: skip
    ctx = make_context(config, tokenizer, PromptEncoder(tokenizer, "model"))
    sample = asyncio.run(multi_turn(PromptRecord("6*7=", "42"), Scripted(), SamplingParams(max_new_tokens=80), ctx))
    (env,) = envs
    assert env.actions[0].tool_call == ToolCall("mul", {"a": 6, "b": 7}) and env.actions[1].tool_call is None
    conversation = [
        {"role": "user", "content": "6*7="},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]
    whole = tokenizer.apply_chat_template(conversation, tools=Multiplier.tools, tokenize=False)
    assert whole.startswith('<|system|>tools:{"type": "function", "function": {"name": "mul"')
    assert tokenizer.decode(sample.prompt_ids + sample.response_ids) == whole
    assert sample.prompt_ids + sample.response_ids == tokenizer.encode(whole, add_special_tokens=False)
    masked_out = [t for t, m in zip(sample.response_ids, sample.loss_mask, strict=True) if not m]
    assert tokenizer.decode(masked_out) == "<|tool|>42<|end|><|assistant|>"  # the tool's turn, not trained
    assert sample.metadata["episode"]["env_reward"] == 1.0 and sample.metadata["episode"]["end_reason"] == "done"


class RefusingEngine:
    """Test double (not an engine): aborts every request before its first id, as SGLang does for a request it
    refuses."""

    name = "refusing"
    weight_version = 0

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, requests):
        from miles_rollout.types import FinishReason, GenerateResult

        self.calls += 1
        return [GenerateResult(r.request_id, [], [], FinishReason.ABORT, [0]) for r in requests]


def test_partial_rollouts_do_not_retry_a_request_the_engine_refuses():
    engine = RefusingEngine()
    client = EngineClient(engine, continue_aborted=True)
    result = asyncio.run(client.generate([1, 2], SamplingParams(max_new_tokens=8)))
    assert result.output_ids == [] and engine.calls == 2 and client.num_continued == 1  # one try, then it stops
