import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_rollout.data import PromptDataError, PromptStream, load_prompts, write_jsonl
from miles_rollout.rewards import exact_match, resolve_reward
from miles_rollout.tasks.arithmetic import arithmetic_prompts, build_char_tokenizer, split_train_eval
from miles_rollout.types import PromptRecord, Sample


def test_jsonl_with_custom_keys(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"q": "1+2=", "a": 3, "src": "x"}\n\n{"q": "2+2=", "a": "4"}\n')
    records = load_prompts(path, prompt_key="q", label_key="a")
    assert [(r.prompt, r.label) for r in records] == [("1+2=", "3"), ("2+2=", "4")]
    assert records[0].metadata == {"src": "x"}


def test_parquet_with_custom_keys(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["3+4="], "answer": ["7"]}), path)
    records = load_prompts(path, prompt_key="question", label_key="answer")
    assert [(r.prompt, r.label) for r in records] == [("3+4=", "7")]


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2=", "label": \n')
    with pytest.raises(PromptDataError, match=r"bad.jsonl:2: invalid JSON"):
        load_prompts(path)


def test_missing_key_names_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": "2+2="}\n')
    with pytest.raises(PromptDataError, match=r"p.jsonl:line 2: missing key\(s\) \['label'\]"):
        load_prompts(path)


def test_non_object_line_and_unknown_type(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(PromptDataError, match="p.jsonl:1: expected a JSON object"):
        load_prompts(path)
    with pytest.raises(PromptDataError, match="unsupported prompt file type '.csv'"):
        (tmp_path / "p.csv").write_text("x")
        load_prompts(tmp_path / "p.csv")


def test_write_then_load_round_trip(tmp_path):
    records = arithmetic_prompts(5, seed=3)
    assert load_prompts(write_jsonl(records, tmp_path / "a.jsonl")) == records
    assert json.loads((tmp_path / "a.jsonl").read_text().splitlines()[0]).keys() == {"prompt", "label"}


def test_arithmetic_is_seeded_and_correct():
    assert arithmetic_prompts(20, seed=1) == arithmetic_prompts(20, seed=1) != arithmetic_prompts(20, seed=2)
    for r in arithmetic_prompts(50, seed=0, operations=("+", "-", "*")):
        a, op, b = r.prompt[:2], r.prompt[2], r.prompt[3:5]
        assert r.prompt.endswith("=")
        assert int(r.label) == eval(f"{int(a)}{op}{int(b)}")


def test_held_out_prompts_never_in_training():
    train, held_out = split_train_eval(5000, 300, seed=0)
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}


def test_char_tokenizer_round_trip():
    tok = build_char_tokenizer()
    ids = tok.encode("37+58=")
    assert len(ids) == 6 and tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "37+58="


def test_prompt_stream_covers_each_prompt_once_per_epoch():
    records = [PromptRecord(str(i), str(i)) for i in range(10)]
    stream = PromptStream(records, seed=0)
    first_epoch = stream.next_batch(10)
    assert sorted(r.prompt for r in first_epoch) == sorted(r.prompt for r in records)
    assert stream.epoch == 0
    stream.next_batch(1)
    assert stream.epoch == 1


def sample(text: str, label: str) -> Sample:
    return Sample(0, "p", label, [1], [2], [0.0], [1], response_text=text)


def test_exact_match_and_registry():
    assert exact_match(sample(" 95 ", "95")) == 1.0
    assert exact_match(sample("96", "95")) == 0.0
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("miles_rollout.rewards.exact_match") is exact_match


@pytest.mark.parametrize(
    "name, message",
    [
        ("nope", "unknown reward 'nope'"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("miles_rollout.rewards:missing", "has no attribute 'missing'"),
        ("miles_rollout.rewards:_REGISTRY", "resolves to a dict, not a function"),
    ],
)
def test_invalid_rewards_are_named(name, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward(name)


def test_prompts_given_as_messages(tmp_path):
    path = tmp_path / "chat.jsonl"
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    path.write_text(json.dumps({"prompt": conversation, "label": "Paris"}) + "\n")
    [record] = load_prompts(path)
    assert record.messages == conversation and record.prompt == "Capital of France?"
    assert load_prompts(write_jsonl([record], tmp_path / "again.jsonl")) == [record]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], r"chat.jsonl:line 1: prompt: an empty list of messages"),
        ([{"role": "user"}], r"chat.jsonl:line 1: prompt\[0\]: expected"),
        ([{"role": "narrator", "content": "x"}], r"prompt\[0\].role: 'narrator' is not one of"),
    ],
)
def test_malformed_messages_name_the_line_and_entry(tmp_path, prompt, message):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "label": "x"}) + "\n")
    with pytest.raises(PromptDataError, match=message):
        load_prompts(path)


@pytest.mark.parametrize("value", ["3", None, float("nan"), [1.0]])
def test_a_reward_that_is_not_a_number_names_the_function_and_the_value(value):
    from miles_rollout.rewards import RewardError, score

    with pytest.raises(RewardError, match=rf"reward 'my.rewards:f' returned {re.escape(repr(value)[:20])}"):
        score(lambda s: value, sample("an answer", "95"), "my.rewards:f")
    assert score(lambda s: True, sample("a", "b"), "f") == 1.0  # bool and ints are numbers
    import torch

    assert score(lambda s: torch.tensor(0.25), sample("a", "b"), "f") == 0.25  # a reward model's 0-d tensor
    with pytest.raises(RewardError, match=r"returned tensor\(\[1\., 2\.\]\)"):
        score(lambda s: torch.tensor([1.0, 2.0]), sample("a", "b"), "f")
