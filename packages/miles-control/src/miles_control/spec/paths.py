"""Every field of a job spec that names a file or folder, in one table: the API confines each under its root, and
`miles run` resolves each relative value against the job file's folder (a `--set` value against the working
directory). A field that is not in the table is never opened as a path; `tests/test_spec_paths.py` walks the
spec's models and fails on a path-like field the table does not hold.

A Hub id (`data.path` of `source: hf`, `model.name` of `source: hub`) is not a path: once a spec is loaded, a
relative value of `data.path` means a Hub id and is only ever looked up in the Hugging Face cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

Root = Literal["data", "model", "runs"]

# location in the spec (`*`: every item of a list) → (the server root it must lie under, what it names)
PATH_FIELDS: dict[tuple[str, ...], tuple[Root, str]] = {
    ("model", "path"): ("model", "model folder"),
    ("train", "teacher"): ("model", "teacher folder"),
    ("train", "critic", "model"): ("model", "critic folder"),
    ("data", "path"): ("data", "prompt file"),
    ("data", "eval_path"): ("data", "prompt file"),
    ("data", "chat_template"): ("data", "chat template"),
    ("output_dir",): ("runs", "output folder"),
    ("tracking", "*", "dir"): ("runs", "tracking folder"),
    ("sync", "dir"): ("runs", "weights folder"),
    ("rollout", "engine", "log_dir"): ("runs", "log folder"),
    ("rollout", "judge", "model"): ("model", "judge folder"),
}

# named choices of path fields: data.chat_template's, rollout.judge.model's (the job's own model)
NOT_A_PATH = {("data", "chat_template"): {"none", "model"}, ("rollout", "judge", "model"): {"policy"}}


def is_hub_dataset(data: dict[str, Any], value: str) -> bool:
    """Whether `data.path`'s `value` names a Hub dataset: `source: hf` and a valid Hub id (never `./x` or `/x`)."""
    from miles_control.spec.model_sources import check_repo_id

    if (data.get("data") or {}).get("source") != "hf" or value.startswith(("/", ".", "~")):
        return False
    try:
        check_repo_id(value)
    except ValueError:
        return False
    return True


def path_values(data: dict[str, Any]) -> Iterator[tuple[tuple[str, ...], dict[str, Any], str, tuple[Root, str]]]:
    """(location, the mapping that holds it, its key, (root, what it names)) of every path field a raw spec sets to a
    string."""
    for loc, root in PATH_FIELDS.items():
        nodes: list[tuple[tuple[str, ...], Any]] = [((), data)]
        for key in loc[:-1]:
            step: list[tuple[tuple[str, ...], Any]] = []
            for where, node in nodes:
                if key == "*" and isinstance(node, list):
                    step += [((*where, str(i)), item) for i, item in enumerate(node)]
                elif isinstance(node, dict) and key in node:
                    step.append(((*where, key), node[key]))
            nodes = step
        for where, node in nodes:
            value = node.get(loc[-1]) if isinstance(node, dict) else None
            if isinstance(value, str) and value not in NOT_A_PATH.get(loc, ()):
                yield (*where, loc[-1]), node, loc[-1], root


def resolve_relative(data: dict[str, Any], base: Path, only: set[tuple[str, ...]] | None = None) -> None:
    """Make the relative paths of a raw spec absolute against `base` (in place); with `only`, just those locations.
    A relative `data.path` that names a Hub dataset and no file under `base` stays a Hub id."""
    for loc, node, key, _ in list(path_values(data)):
        value = node[key]
        if only is not None and loc not in only:
            continue
        if Path(value).expanduser().is_absolute():
            node[key] = str(Path(value).expanduser())
            continue
        if loc == ("data", "path") and is_hub_dataset(data, value) and not (base / value).exists():
            continue
        node[key] = str((base / value).resolve())
