"""Prompt records → the token ids a model expects: plain text, or rendered with a chat template.

`data.chat_template: none` encodes a prompt's text as it is (a base model, or the built-in arithmetic
model). `model` renders every prompt with the tokenizer's own template, the way an Instruct model was
trained to see a conversation: a text prompt becomes one user turn, a prompt given as `messages` is
rendered as it is, and `data.system_prompt` (if any) opens the conversation unless the messages bring
their own. A path to a Jinja file renders with that template instead.
"""

from __future__ import annotations

from pathlib import Path

from miles_rollout.data import PromptDataError
from miles_rollout.types import PromptRecord


class PromptEncoder:
    """Encodes prompt records for one tokenizer; built once per rollout worker."""

    def __init__(self, tokenizer, chat_template: str = "none", system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.template: str | None = None
        if chat_template == "model":
            self.template = getattr(tokenizer, "chat_template", None)
            if not self.template:
                raise PromptDataError(
                    "data.chat_template: model — this model's tokenizer has no chat template; "
                    "give a Jinja file instead, or none for plain text prompts"
                )
        elif chat_template != "none":
            path = Path(chat_template)
            try:
                self.template = path.read_text()
            except OSError as exc:
                raise PromptDataError(f"data.chat_template: cannot read {path}: {exc.strerror}") from None

    def messages(self, record: PromptRecord) -> list[dict[str, str]]:
        """The conversation a record stands for: its messages, or its text as one user turn, after the system
        prompt (unless the messages open with their own)."""
        turns = record.messages if record.messages is not None else [{"role": "user", "content": record.prompt}]
        if self.system_prompt is not None and turns[0]["role"] != "system":
            turns = [{"role": "system", "content": self.system_prompt}, *turns]
        return turns

    def text(self, record: PromptRecord) -> str:
        """The prompt exactly as the model reads it (the rendered template, ending where the answer starts)."""
        if self.template is None:
            if record.messages is not None:
                raise PromptDataError(
                    "a prompt given as messages needs data.chat_template (model, or a Jinja file) to be rendered"
                )
            return record.prompt
        try:
            return self.tokenizer.apply_chat_template(
                self.messages(record), chat_template=self.template, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja2 raises several types; the user needs the message
            raise PromptDataError(f"data.chat_template: rendering {record.prompt[:60]!r} failed: {exc}") from exc

    def encode(self, record: PromptRecord) -> list[int]:
        if self.template is None:
            return self.tokenizer.encode(self.text(record))
        # The template writes the special tokens itself (a BOS, turn markers): none are added again.
        return self.tokenizer.encode(self.text(record), add_special_tokens=False)
