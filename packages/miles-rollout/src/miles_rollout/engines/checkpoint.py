"""What an engine reads off a checkpoint folder before loading it: its dtype and whether its head is tied.

Both engines resolve `dtype: auto` here, and the job runtime asks the same function which dtype the
engines will hold (the default wire dtype of weight pushes), so the three cannot disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def read_config(model_path: str | Path) -> dict:
    path = Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file (an HF model folder has a config.json)") from None


def checkpoint_dtype(model_path: str | Path) -> str:
    """The dtype the checkpoint declares (`dtype`, or `torch_dtype` before transformers 5); float32 when it
    declares none or one no engine runs."""
    config = read_config(model_path)
    declared = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return declared if declared in DTYPES else "float32"


def engine_dtype(dtype: str, model_path: str | Path) -> str:
    """An engine config's `dtype`, with `auto` resolved to the checkpoint's."""
    return checkpoint_dtype(model_path) if dtype == "auto" else dtype


def tied_embeddings(model_path: str | Path) -> bool:
    """Whether the model's output head is its input embedding (`tie_word_embeddings`, with the model class's
    default when the file leaves it out)."""
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(str(model_path)), "tie_word_embeddings", False))
