"""Prompt data of a job, loaded in the driver so bad files fail before any model loads."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from miles_control.job.hub import HubError, snapshot
from miles_rollout.config import DataConfig
from miles_rollout.data import PromptDataError, load_prompts, records_from_rows
from miles_rollout.tasks.arithmetic import split_train_eval
from miles_rollout.types import PromptRecord


def load_job_prompts(config: DataConfig, environment: Any = None) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(training prompts, held-out prompts). `environment`: `rollout.environment`, whose dataset `source:
    environment` reads (a verifiers environment's)."""
    if config.source == "environment":
        from miles_rollout.hubs.verifiers_env import records

        if getattr(environment, "type", None) != "verifiers":
            raise PromptDataError("data.source: environment reads the dataset of a verifiers rollout.environment")
        try:
            return records(environment, config.num_eval)
        except ValueError as exc:
            raise PromptDataError(str(exc)) from None
    if config.source == "arithmetic":
        return split_train_eval(config.num_train, config.num_eval, config.seed, config.digits, config.operations)
    if config.path is None:
        raise PromptDataError(f"data.path: required when data.source is {config.source!r}")
    if config.source == "hf":
        return load_hf_prompts(config)
    train = load_prompts(config.path, config.prompt_key, config.label_key, config.image_key)
    _check_messages(train, config.path, config.chat_template)
    if config.eval_path is not None:
        held_out = load_prompts(config.eval_path, config.prompt_key, config.label_key, config.image_key)
        _check_messages(held_out, config.eval_path, config.chat_template)
        return train, held_out
    if len(train) <= config.num_eval:
        raise PromptDataError(
            f"{config.path}: {len(train)} prompts cannot spare data.num_eval={config.num_eval} "
            "for evaluation; give data.eval_path or lower data.num_eval"
        )
    # Without an eval file the last num_eval prompts are held out.
    return train[: -config.num_eval], train[-config.num_eval :]


def _check_messages(records: list[PromptRecord], path: str, chat_template: str) -> None:
    if chat_template == "none":
        number = next((i for i, r in enumerate(records, start=1) if r.messages is not None), None)
        if number is not None:
            raise PromptDataError(
                f"{path}: prompt {number} is a list of messages; set data.chat_template (model, or a Jinja file) "
                "to render conversations"
            )
        number = next((i for i, r in enumerate(records, start=1) if r.images), None)
        if number is not None:
            raise PromptDataError(
                f"{path}: prompt {number} has images; set data.chat_template (model, or a Jinja file): the template "
                "writes where each image goes"
            )


# `source: hf` files, by suffix: the `datasets` builder that reads them
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}


def load_hf_prompts(config: DataConfig) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """`data.source: hf`: (training prompts, held-out prompts) read through the `datasets` library from a Hub id,
    a local dataset folder or files. The rows become prompt records as a JSONL file's do; the held-out prompts are
    `eval_split`, an `eval_fraction` of `split` (a seeded shuffle), or its last `num_eval` rows."""
    assert config.path is not None
    splits = _open_hf(config)
    train = _split(splits, config.split, "data.split", config)
    if config.eval_split is not None:
        held_out = _split(splits, config.eval_split, "data.eval_split", config)
    elif config.eval_fraction is not None:
        parts = train.train_test_split(test_size=config.eval_fraction, seed=config.seed, shuffle=True)
        if len(parts["test"]) == 0 or len(parts["train"]) == 0:
            raise PromptDataError(
                f"data.eval_fraction: {config.eval_fraction} of {len(train)} rows leaves a side empty"
            )
        train, held_out = parts["train"], parts["test"]
    else:
        if len(train) <= config.num_eval:
            raise PromptDataError(
                f"data.num_eval: split {config.split!r} of {config.path} has {len(train)} rows, which cannot spare "
                f"{config.num_eval} for evaluation; give data.eval_split or data.eval_fraction, or lower data.num_eval"
            )
        train, held_out = (
            train.select(range(len(train) - config.num_eval)),
            train.select(range(len(train) - config.num_eval, len(train))),
        )
    where = f"{config.path}"
    records = [_records(part, f"{where} [{name}]", config) for part, name in ((train, "train"), (held_out, "eval"))]
    for part in records:
        _check_messages(part, where, config.chat_template)
    return records[0], records[1]


def _open_hf(config: DataConfig) -> Any:
    """The dataset `config.path` names, as a `DatasetDict` of its splits (or one `Dataset`, from `save_to_disk`)."""
    import datasets

    path = config.path
    assert path is not None
    local = Path(path).expanduser()
    try:
        if not local.is_absolute() and not path.startswith((".", "~")) and not glob.has_magic(path):
            # A relative path is a Hub id (a job file's paths are made absolute when it is loaded, an API job's by the
            # server's policy): looked up in the Hugging Face cache only, never opened from the working directory.
            from miles_control.spec.config import check_repo_id

            try:
                check_repo_id(path)
            except ValueError as exc:
                raise PromptDataError(
                    f"data.path: {path} is neither a Hub id nor an absolute path (a local path is absolute or starts "
                    f"with ./): {exc}"
                ) from None
            try:
                folder = snapshot(path, "data.path", repo_type="dataset", revision=config.revision)
            except HubError as exc:  # a local path meant here would have been made absolute when the spec loaded
                raise HubError(
                    f"{exc} (read as a Hub id: no file or folder {path!r} lies beside the job file; a local path "
                    "is absolute or starts with ./)"
                ) from None
            return datasets.load_dataset(str(folder))
        if glob.has_magic(path) or local.is_file():
            files = sorted(glob.glob(str(local))) if glob.has_magic(path) else [str(local)]
            if not files:
                raise PromptDataError(f"data.path: no files match {path}")
            suffixes = {Path(f).suffix for f in files}
            unknown = suffixes - set(BUILDERS)
            if unknown or len({BUILDERS[s] for s in suffixes}) != 1:
                raise PromptDataError(
                    f"data.path: {path} gives files of type(s) {sorted(suffixes)}; use one of "
                    f"{', '.join(sorted(BUILDERS))}"
                )
            return datasets.load_dataset(BUILDERS[suffixes.pop()], data_files={"train": files})
        if local.is_dir():
            if (local / "dataset_dict.json").exists() or (local / "state.json").exists():
                return datasets.load_from_disk(str(local))
            return datasets.load_dataset(str(local))
        raise PromptDataError(f"data.path: {path} does not exist")
    except (PromptDataError, HubError):
        raise
    except Exception as exc:  # the datasets library raises many types, for files and for layouts
        import re

        empty = re.match(r'Instruction "([^"]+)" corresponds to no data', str(exc))
        if empty:  # a split with no rows (datasets refuses the whole dataset then)
            name = empty.group(1)
            field = {config.split: "data.split", config.eval_split: "data.eval_split"}.get(name, "data.path")
            raise PromptDataError(f"{field}: split {name!r} of {path} is empty") from None
        raise PromptDataError(
            f"data.path: {path}: the datasets library cannot read it: {type(exc).__name__}: {exc}"
        ) from exc


def _split(splits: Any, name: str, field: str, config: DataConfig) -> Any:
    import datasets

    if isinstance(splits, datasets.Dataset):  # save_to_disk of one split
        if name != "train":
            raise PromptDataError(f"{field}: {config.path} holds one split, not a split named {name!r}")
        part = splits
    elif name not in splits:
        raise PromptDataError(f"{field}: {config.path} has no split {name!r} (its splits: {', '.join(splits)})")
    else:
        part = splits[name]
    if config.map is not None:
        part = _apply_map(part, config.map)
    if len(part) == 0:
        raise PromptDataError(f"{field}: split {name!r} of {config.path} is empty")
    columns = set(part.column_names)
    for key_field in ("prompt_key", "label_key", "image_key"):
        key = getattr(config, key_field)
        if key is not None and key not in columns:
            raise PromptDataError(
                f"data.{key_field}: no column {key!r} in split {name!r} of {config.path} (its columns: "
                f"{', '.join(sorted(columns))})"
            )
    return part


def _apply_map(part: Any, path: str) -> Any:
    from miles_rollout.plugin_check import resolve_dotted

    try:
        function = resolve_dotted(path)
    except Exception as exc:
        raise PromptDataError(f"data.map: cannot load {path!r}: {exc}") from exc
    try:
        return part.map(function, load_from_cache_file=False, desc=None)
    except Exception as exc:
        raise PromptDataError(f"data.map: {path} failed on a row: {type(exc).__name__}: {exc}") from exc


def _records(part: Any, source: str, config: DataConfig) -> list[PromptRecord]:
    rows = ((f"row {i}", row) for i, row in enumerate(part, start=1))
    return records_from_rows(rows, source, config.prompt_key, config.label_key, config.image_key)
