import pytest

from miles_control.job.data import load_job_prompts
from miles_rollout.config import DataConfig
from miles_rollout.data import PromptDataError


def test_file_source_holds_out_the_tail(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"q": "{i}+1=", "a": "{i + 1}"}}\n' for i in range(10)))
    train, held_out = load_job_prompts(
        DataConfig(source="file", path=str(path), prompt_key="q", label_key="a", num_eval=3)
    )
    assert [r.prompt for r in train] == [f"{i}+1=" for i in range(7)]
    assert [r.label for r in held_out] == ["8", "9", "10"]


def test_file_source_errors(tmp_path):
    with pytest.raises(ValueError, match="data.path: required"):
        DataConfig(source="file")
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "1+1=", "label": "2"}\n')
    with pytest.raises(PromptDataError, match="cannot spare data.num_eval=500"):
        load_job_prompts(DataConfig(source="file", path=str(path)))


def test_arithmetic_source_is_seeded():
    """The same seed gives the same prompts (a resumed or repeated job trains on what the first saw); another
    seed gives others; held-out prompts are never training prompts."""
    config = DataConfig(num_train=200, num_eval=20, seed=4)
    train, held_out = load_job_prompts(config)
    assert (train, held_out) == load_job_prompts(DataConfig(num_train=200, num_eval=20, seed=4))
    assert 190 <= len(train) <= 200 and len(held_out) == 20  # training prompts equal to a held-out one are left out
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}
    other, _ = load_job_prompts(DataConfig(num_train=200, num_eval=20, seed=5))
    assert [r.prompt for r in other] != [r.prompt for r in train]
