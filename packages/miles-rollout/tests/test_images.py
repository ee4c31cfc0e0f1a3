"""Prompts with images: read from JSONL paths, Parquet `datasets` Image columns and `datasets` rows; a bad image is
an error naming the file, the row and the column; the processor renders them into ids and pixel inputs."""

import io
import json

import pytest

from miles_rollout.data import PromptDataError, load_prompts, records_from_rows
from miles_rollout.tasks.counting import QUESTION, counting_rows, write_jsonl, write_parquet

pytest.importorskip("PIL", reason="Pillow is not installed (the vision extra)")


def _png(color: str = "red", size: int = 56) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_jsonl_file_gives_image_paths_relative_to_itself_and_a_parquet_file_an_image_column(tmp_path):
    rows = counting_rows(5, seed=3)
    jsonl = write_jsonl(rows, tmp_path / "sub" / "train.jsonl")
    parquet = write_parquet(rows, tmp_path / "train.parquet")
    from_jsonl, from_parquet = load_prompts(jsonl, image_key="images"), load_prompts(parquet, image_key="images")
    for records in (from_jsonl, from_parquet):
        assert [r.label for r in records] == [label for _, label in rows]
        assert [r.images for r in records] == [[image] for image, _ in rows]  # the files' bytes, unchanged
        assert all(r.prompt == QUESTION and r.metadata == {} for r in records)  # the column is not metadata


def test_a_prompt_may_have_several_images_or_none(tmp_path):
    (tmp_path / "a.png").write_bytes(_png("red"))
    (tmp_path / "b.png").write_bytes(_png("blue"))
    lines = [{"prompt": "two", "label": "2", "images": ["a.png", "b.png"]}, {"prompt": "one", "label": "1",
             "images": "a.png"}, {"prompt": "text only", "label": "0"}]  # fmt: skip
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    records = load_prompts(tmp_path / "p.jsonl", image_key="images")
    assert [len(r.images) for r in records] == [2, 1, 0]
    assert records[0].images == [_png("red"), _png("blue")]


def test_rows_from_the_datasets_library_give_decoded_images(tmp_path):
    import datasets

    rows = counting_rows(3, seed=0)
    parquet = write_parquet(rows, tmp_path / "t.parquet")
    part = datasets.load_dataset("parquet", data_files={"train": str(parquet)})["train"]  # Image cells: PIL images
    records = records_from_rows(((f"row {i}", row) for i, row in enumerate(part, 1)), "hf", image_key="images")
    from PIL import Image

    for record, (image, _) in zip(records, rows, strict=True):
        # re-encoded as PNG from the decoded image: the same pixels
        assert list(Image.open(io.BytesIO(record.images[0])).getdata()) == list(Image.open(io.BytesIO(image)).getdata())


@pytest.mark.parametrize(
    ("cell", "said"),
    [
        ("missing.png", "p.jsonl:line 2: images: cannot read image"),
        (["ok.png", "broken.png"], "p.jsonl:line 2: images[1]: not a readable image"),
        (7, "p.jsonl:line 2: images: expected an image (a path, the bytes of an image file, or a datasets Image)"),
    ],
)
def test_an_image_that_cannot_be_read_is_named_by_row_and_column(tmp_path, cell, said):
    (tmp_path / "ok.png").write_bytes(_png())
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    lines = [{"prompt": "a", "label": "1", "images": "ok.png"}, {"prompt": "b", "label": "1", "images": cell}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    with pytest.raises(PromptDataError, match="images") as info:
        load_prompts(tmp_path / "p.jsonl", image_key="images")
    assert said in str(info.value)


def test_an_image_path_stays_inside_the_data_files_folder(tmp_path):
    """A data file names no image outside its own folder (`..` or an absolute path elsewhere): a job's data file is
    confined (the API's data root), and its images reach the store."""
    outside = tmp_path / "secret.png"
    outside.write_bytes(_png())
    (tmp_path / "data").mkdir()
    for cell in ("../secret.png", str(outside)):
        (tmp_path / "data" / "p.jsonl").write_text(json.dumps({"prompt": "a", "label": "1", "images": cell}))
        with pytest.raises(PromptDataError, match="lies outside the data file's folder"):
            load_prompts(tmp_path / "data" / "p.jsonl", image_key="images")
    inside = tmp_path / "data" / "ok.png"
    inside.write_bytes(_png())
    (tmp_path / "data" / "p.jsonl").write_text(json.dumps({"prompt": "a", "label": "1", "images": str(inside)}))
    assert load_prompts(tmp_path / "data" / "p.jsonl", image_key="images")[0].images == [_png()]


def test_without_an_image_key_a_column_named_images_is_metadata(tmp_path):
    """A text dataset may have a column called `images` (URLs, captions): it stays the reward's metadata."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "label": "1", "images": ["https://x/y.png"]}))
    record = load_prompts(tmp_path / "p.jsonl")[0]
    assert record.images == [] and record.metadata == {"images": ["https://x/y.png"]}


def test_another_image_column_is_named_by_image_key(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "label": "1", "picture": "a.png", "images": 3}))
    record = load_prompts(tmp_path / "p.jsonl", image_key="picture")[0]
    assert record.images == [_png()] and record.metadata == {"images": 3}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm_dir(request, tmp_path_factory):
    from miles_control.testing.tiny_models import save_tiny_vision_model

    return save_tiny_vision_model(tmp_path_factory.mktemp(request.param), request.param)


def test_the_processor_expands_each_image_to_its_features_and_gives_its_pixels(vlm_dir):
    from miles_rollout.prompts import load_encoder
    from miles_rollout.types import PromptRecord

    encoder = load_encoder(vlm_dir, "model")
    big, small = _png("red", 56), _png("blue", 28)
    ids, multimodal = encoder.inputs(PromptRecord("how many?", "1", images=[big, small]))
    pad = encoder.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grids = multimodal["image_grid_thw"].tolist()
    assert grids == [[1, 4, 4], [1, 2, 2]]  # 56 px: 4 × 4 patches of 14 px; 28 px: 2 × 2
    assert ids.count(pad) == 4 + 1  # every 2 × 2 patches make one placeholder
    assert multimodal["mm_token_type_ids"] == [int(i == pad) for i in ids]
    assert multimodal["pixel_values"].shape[0] == 16 + 4
    text_ids, none = encoder.inputs(PromptRecord("how many?", "1"))
    assert none is None and pad not in text_ids
    with pytest.raises(PromptDataError, match="images needs data.chat_template"):
        load_encoder(vlm_dir, "none").inputs(PromptRecord("x", "1", images=[big]))


def test_a_text_model_has_no_processor_for_images(tmp_path):
    from miles_rollout.prompts import PromptEncoder
    from miles_rollout.tasks.arithmetic import build_char_tokenizer
    from miles_rollout.types import PromptRecord

    with pytest.raises(PromptDataError, match="has 1 image"):
        PromptEncoder(build_char_tokenizer()).inputs(PromptRecord("1+1=", "2", images=[_png()]))
