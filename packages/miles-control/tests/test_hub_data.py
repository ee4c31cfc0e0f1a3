"""Issue 39, items 1-2: prompts through the `datasets` library (`data.source: hf`) and models by Hub id
(`model.source: hub`), offline against a Hugging Face cache laid out as a download leaves it (no network here)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_control.job.assets import resolve_model_path
from miles_control.job.data import load_job_prompts
from miles_control.job.hub import HubError
from miles_control.spec.load import SpecError, parse_spec
from miles_control.testing.servers import put_in_hub_cache
from miles_rollout.config import DataConfig
from miles_rollout.data import PromptDataError


def parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def sums(start, n):
    return [{"question": f"{i}+1=", "answer": str(i + 1), "source": "sums"} for i in range(start, start + n)]


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache that huggingface_hub reads offline (its constants are read at import)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    return cache


def hf(path, **fields) -> DataConfig:
    return DataConfig(source="hf", path=str(path), prompt_key="question", label_key="answer", **fields)


def test_parquet_files_by_glob_with_a_held_out_tail_or_fraction(tmp_path):
    parquet(tmp_path / "data" / "train-0.parquet", sums(0, 6))
    parquet(tmp_path / "data" / "train-1.parquet", sums(6, 4))
    train, held_out = load_job_prompts(hf(tmp_path / "data" / "train-*.parquet", num_eval=3))
    assert [r.prompt for r in train] == [f"{i}+1=" for i in range(7)]  # both files, in order
    assert [r.label for r in held_out] == ["8", "9", "10"]
    assert train[0].metadata == {"source": "sums"}  # other columns are the record's metadata
    train, held_out = load_job_prompts(hf(tmp_path / "data" / "*.parquet", eval_fraction=0.2, seed=1))
    assert len(train) == 8 and len(held_out) == 2
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}
    again = load_job_prompts(hf(tmp_path / "data" / "*.parquet", eval_fraction=0.2, seed=1))
    assert [r.prompt for r in again[1]] == [r.prompt for r in held_out]  # seeded: a resume sees the same split


def test_csv_and_jsonl_files_a_messages_column_and_a_map_function(tmp_path, monkeypatch):
    (tmp_path / "p.csv").write_text("q,a\n" + "".join(f"{i}+2=,{i + 2}\n" for i in range(5)))
    train, held_out = load_job_prompts(
        DataConfig(source="hf", path=str(tmp_path / "p.csv"), prompt_key="q", label_key="a", num_eval=1)
    )
    assert [(r.prompt, r.label) for r in held_out] == [("4+2=", "6")]
    rows = [{"messages": [{"role": "user", "content": f"{i}+3="}], "label": str(i + 3)} for i in range(4)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "shaping.py").write_text("def upper(row):\n    return {**row, 'label': 'n' + row['label']}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train, _ = load_job_prompts(
        DataConfig(source="hf", path=str(tmp_path / "m.jsonl"), prompt_key="messages", num_eval=1,
                   chat_template="model", map="shaping:upper")
    )  # fmt: skip
    assert train[0].messages == [{"role": "user", "content": "0+3="}] and train[0].prompt == "0+3="
    assert [r.label for r in train] == ["n3", "n4", "n5"]  # the map ran on every row


def test_bad_input_names_the_field(tmp_path, monkeypatch):
    parquet(tmp_path / "d.parquet", sums(0, 10))
    with pytest.raises(PromptDataError, match=r"data.prompt_key: no column 'prompt'.*columns: answer, question"):
        load_job_prompts(DataConfig(source="hf", path=str(tmp_path / "d.parquet"), label_key="answer", num_eval=2))
    with pytest.raises(PromptDataError, match=r"data.label_key: no column 'label'"):
        load_job_prompts(DataConfig(source="hf", path=str(tmp_path / "d.parquet"), prompt_key="question", num_eval=2))
    with pytest.raises(PromptDataError, match=r"data.eval_split: .* has no split 'test' \(its splits: train\)"):
        load_job_prompts(hf(tmp_path / "d.parquet", eval_split="test"))
    with pytest.raises(PromptDataError, match=r"data.num_eval: .* has 10 rows"):
        load_job_prompts(hf(tmp_path / "d.parquet"))
    with pytest.raises(PromptDataError, match=r"data.path: no files match"):
        load_job_prompts(hf(tmp_path / "none-*.parquet"))
    with pytest.raises(PromptDataError, match=r"data.path: .* does not exist"):
        load_job_prompts(hf(tmp_path / "missing"))
    (tmp_path / "failing_map.py").write_text("def boom(row):\n    raise KeyError('nope')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PromptDataError, match=r"data.map: failing_map:boom failed on a row: KeyError"):
        load_job_prompts(hf(tmp_path / "d.parquet", map="failing_map:boom", num_eval=2))
    empty = tmp_path / "empty"  # a folder whose files name its splits; test.csv has no rows
    empty.mkdir()
    (empty / "train.csv").write_text("question,answer\n1+1=,2\n2+2=,4\n")
    (empty / "test.csv").write_text("question,answer\n")
    with pytest.raises(PromptDataError, match=r"data.eval_split: split 'test' of .* is empty"):
        load_job_prompts(hf(empty, eval_split="test"))
    with pytest.raises(ValueError, match=r"data.split: only for data.source hf"):
        DataConfig(source="file", path="x.jsonl", split="test")
    with pytest.raises(ValueError, match=r"data.path: required when data.source is 'hf'"):
        DataConfig(source="hf")


def test_a_hub_dataset_id_is_read_from_the_cache_offline(tmp_path, offline_cache):
    repo = tmp_path / "repo"
    parquet(repo / "data" / "train-00000-of-00001.parquet", sums(0, 8))
    parquet(repo / "data" / "test-00000-of-00001.parquet", sums(100, 3))
    put_in_hub_cache(offline_cache, "miles-test/sums", repo, repo_type="dataset")
    train, held_out = load_job_prompts(hf("miles-test/sums", eval_split="test"))
    assert [r.label for r in train] == [str(i + 1) for i in range(8)]
    assert [r.label for r in held_out] == ["101", "102", "103"]
    with pytest.raises(HubError, match=r"data.path: dataset 'miles-test/other' is not in the Hugging Face cache "
                                       rf"{offline_cache} and HF_HUB_OFFLINE is set"):  # fmt: skip
        load_job_prompts(hf("miles-test/other", eval_split="test"))


def test_a_hub_model_id_resolves_to_the_cached_snapshot_offline(tmp_path, offline_cache):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    snapshot = put_in_hub_cache(offline_cache, "miles-test/tiny", model)
    spec = parse_spec({"name": "hub", "model": {"source": "hub", "name": "miles-test/tiny"}})
    assert resolve_model_path(spec) == snapshot
    spec = parse_spec({"name": "hub", "model": {"source": "hub", "name": "miles-test/absent", "revision": "v1"}})
    with pytest.raises(HubError) as caught:
        resolve_model_path(spec)
    message = str(caught.value)
    assert "model.name: model 'miles-test/absent' at revision 'v1' is not in the Hugging Face cache" in message
    assert str(offline_cache) in message and "HF_HUB_OFFLINE is set" in message
    with pytest.raises(SpecError, match=r"model.name.*is not a Hugging Face Hub id"):
        parse_spec({"name": "hub", "model": {"source": "hub", "name": "not a/valid/id"}})
