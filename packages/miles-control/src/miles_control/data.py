"""Prompt data of a job, loaded in the driver so bad files fail before any model loads."""

from __future__ import annotations

from miles_rollout.config import DataConfig
from miles_rollout.data import PromptDataError, load_prompts
from miles_rollout.tasks.arithmetic import split_train_eval
from miles_rollout.types import PromptRecord


def load_job_prompts(config: DataConfig) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(training prompts, held-out prompts)."""
    if config.source == "arithmetic":
        return split_train_eval(config.num_train, config.num_eval, config.seed, config.digits, config.operations)
    if config.path is None:
        raise PromptDataError("data.path: required when data.source is 'file'")
    train = load_prompts(config.path, config.prompt_key, config.label_key)
    _check_messages(train, config.path, config.chat_template)
    if config.eval_path is not None:
        held_out = load_prompts(config.eval_path, config.prompt_key, config.label_key)
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
