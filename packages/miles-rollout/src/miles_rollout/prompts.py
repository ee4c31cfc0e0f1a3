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
        self._ids: dict[str, list[int]] = {}  # text → ids, see encode
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

    def text(self, record: PromptRecord, tools: list[dict] | None = None) -> str:
        """The prompt exactly as the model reads it (the rendered template, ending where the answer starts);
        `tools`: tool schemas the template renders (an environment's)."""
        if self.template is None:
            if record.messages is not None:
                raise PromptDataError(
                    "a prompt given as messages needs data.chat_template (model, or a Jinja file) to be rendered"
                )
            return record.prompt
        try:
            return self._render(self.messages(record), tools, generation_prompt=True)
        except Exception as exc:  # jinja2 raises several types; the user needs the message
            raise PromptDataError(f"data.chat_template: rendering {record.prompt[:60]!r} failed: {exc}") from exc

    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def encode(self, record: PromptRecord, tools: list[dict] | None = None) -> list[int]:
        """The prompt's ids. A group's samples share their prompt: its text is tokenized once (the last
        `_KEEP_IDS` texts are remembered) and each caller gets its own copy."""
        text = self.text(record, tools) if self.template is not None else self.text(record)
        ids = self._ids.get(text)
        if ids is None:
            # The template writes the special tokens itself (a BOS, turn markers): none are added again.
            ids = (
                self.tokenizer.encode(text)
                if self.template is None
                else self.tokenizer.encode(text, add_special_tokens=False)
            )
            if len(self._ids) >= _KEEP_IDS:
                self._ids.clear()
            self._ids[text] = ids
        return list(ids)

    def turn_ids(self, messages: list[dict], tools: list[dict] | None = None, model_end: str = "") -> list[int]:
        """The ids of environment turns (`messages`: tool results, user feedback) that follow a model turn, up to
        where the model's next turn starts; tokenized once, here, and never again.

        Without a template the messages' contents are encoded as they are. With one, they are what the template
        writes after an assistant turn's content when the messages follow it (rendered after a placeholder
        conversation, so what precedes them cannot change how they tokenize): the rest of the turn's closing, the
        messages' turns and the opening of the next assistant turn. `model_end` is the text of the token the model
        stopped on, which its turn already holds (`<|im_end|>` of a template that closes a turn with `<|im_end|>`
        and a newline: the newline is added here; a closing the model did not write is added whole)."""
        if self.template is None:
            return self.tokenizer.encode("".join(str(m["content"]) for m in messages), add_special_tokens=False)
        base = [{"role": "user", "content": _PLACEHOLDER}, {"role": "assistant", "content": _PLACEHOLDER}]
        try:
            after = self._render(base + messages, tools, generation_prompt=True)
        except Exception as exc:
            raise PromptDataError(
                f"data.chat_template: rendering the environment turn {messages!r:.80} failed: {exc}"
            ) from exc
        if after.count(_PLACEHOLDER) != 2:
            raise PromptDataError("data.chat_template: the template does not write each turn's content as it is")
        # What follows the assistant's content when more turns follow it (a template may render the last turn
        # differently, as Qwen3's adds an empty think block to it alone): its closing, the environment's turns, the
        # next assistant turn's opening.
        text = after[after.rindex(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        if model_end and text.startswith(model_end):
            text = text[len(model_end) :]
        return self.tokenizer.encode(text, add_special_tokens=False)


_KEEP_IDS = 4096  # prompt texts whose ids an encoder remembers (a step's prompts, many times over)
_PLACEHOLDER = "\u2063miles\u2063"  # invisible separators: text no template writes itself
