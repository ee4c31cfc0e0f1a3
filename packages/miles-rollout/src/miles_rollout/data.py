"""Prompt data: JSONL or Parquet files (or any rows) with configurable keys, and a seeded epoch iterator."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

from miles_rollout.types import PromptRecord


class PromptDataError(ValueError):
    """A prompt file that cannot be used; the message names the file and, where known, the line."""


def load_prompts(
    path: str | Path, prompt_key: str = "prompt", label_key: str = "label", image_key: str | None = None
) -> list[PromptRecord]:
    """The prompts of a JSONL or Parquet file; with `image_key`, a row's column of that name (if it has one) holds
    its images, paths relative to the file."""
    path = Path(path)
    if not path.exists():
        raise PromptDataError(f"{path}: no such prompt file")
    if path.suffix == ".parquet":
        rows = _read_parquet(path)
    elif path.suffix in {".jsonl", ".json"}:
        rows = _read_jsonl(path)
    else:
        raise PromptDataError(f"{path}: unsupported prompt file type {path.suffix!r} (use .jsonl or .parquet)")
    return records_from_rows(rows, str(path), prompt_key, label_key, image_key, base=path.parent)


def records_from_rows(
    rows: Iterable[tuple[str, dict]],
    source: str,
    prompt_key: str = "prompt",
    label_key: str = "label",
    image_key: str | None = None,
    base: Path | None = None,
) -> list[PromptRecord]:
    """Prompt records from `(where, row)` pairs: `row[prompt_key]` is a text or a list of {role, content} messages,
    `row[label_key]` the label, `row[image_key]` (with an `image_key`, when the row has it) its images (`miles_rollout.images`: paths relative
    to `base`, bytes, `datasets` Image cells; one or a list), the other columns the record's metadata. Errors name
    `source:where` and the key."""
    from miles_rollout.images import images_of

    records = []
    for where, row in rows:
        missing = [k for k in (prompt_key, label_key) if k not in row]
        if missing:
            raise PromptDataError(f"{source}:{where}: missing key(s) {missing}; present: {sorted(row)}")
        extra = {k: v for k, v in row.items() if k not in (prompt_key, label_key, image_key)}
        images = images_of(row.get(image_key), f"{source}:{where}: {image_key}", base) if image_key else []
        prompt = row[prompt_key]
        if isinstance(prompt, list):
            messages = _messages(prompt, f"{source}:{where}: {prompt_key}")
            user = [m["content"] for m in messages if m["role"] == "user"]
            records.append(
                PromptRecord(
                    user[-1] if user else messages[-1]["content"], str(row[label_key]), extra, messages, images
                )
            )
        else:
            records.append(PromptRecord(str(prompt), str(row[label_key]), extra, images=images))
    if not records:
        raise PromptDataError(f"{source}: no prompts")
    return records


ROLES = ("system", "user", "assistant", "tool")


def _messages(value: list, where: str) -> list[dict[str, str]]:
    """A conversation given as a list of {"role", "content"} objects, checked entry by entry."""
    if not value:
        raise PromptDataError(f"{where}: an empty list of messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise PromptDataError(f'{where}[{i}]: expected {{"role": ..., "content": "text"}}, got {message!r:.80}')
        if message.get("role") not in ROLES:
            raise PromptDataError(f"{where}[{i}].role: {message.get('role')!r} is not one of {', '.join(ROLES)}")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptDataError(f"{path}:{number}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise PromptDataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            yield f"line {number}", row


def _read_parquet(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise PromptDataError(f"{path}: cannot read Parquet: {exc}") from exc
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"row {number}", row


def write_jsonl(records: list[PromptRecord], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for r in records:
            prompt = r.messages if r.messages is not None else r.prompt
            handle.write(json.dumps({"prompt": prompt, "label": r.label, **r.metadata}) + "\n")
    return path


class PromptStream:
    """Endless, seeded iteration over prompts: reshuffled every epoch, never repeating within one."""

    def __init__(self, records: list[PromptRecord], seed: int = 0) -> None:
        if not records:
            raise PromptDataError("no prompts to iterate over")
        self._records = records
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self.epoch = -1

    def next_batch(self, num_prompts: int) -> list[PromptRecord]:
        batch = []
        while len(batch) < num_prompts:
            if not self._order:
                self._order = list(range(len(self._records)))
                self._rng.shuffle(self._order)
                self.epoch += 1
            batch.append(self._records[self._order.pop()])
        return batch
