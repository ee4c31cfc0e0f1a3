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


def load_encoder(
    model_path: str | Path, chat_template: str = "none", system_prompt: str | None = None
) -> PromptEncoder:
    """The encoder of the model in an HF folder: its tokenizer, and a vision-language model's processor (which
    renders prompts with images)."""
    import transformers

    from miles_sync.vision import is_vision_language

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_path))
    processor = None
    if is_vision_language(transformers.AutoConfig.from_pretrained(str(model_path))):
        processor = transformers.AutoProcessor.from_pretrained(str(model_path))
    return PromptEncoder(tokenizer, chat_template, system_prompt, processor)


class PromptEncoder:
    """Encodes prompt records for one tokenizer; built once per rollout worker."""

    def __init__(
        self, tokenizer, chat_template: str = "none", system_prompt: str | None = None, processor=None
    ) -> None:
        """`processor`: a vision-language model's (transformers' `AutoProcessor`), which renders prompts with images:
        it expands each image's placeholder to as many ids as the image has features and makes its pixel inputs."""
        self.tokenizer = tokenizer
        self.processor = processor
        self.system_prompt = system_prompt
        self._vision: dict[tuple, tuple[list[int], dict]] = {}  # (text, images) → inputs, see inputs
        self.template: str | None = None
        self._ids: dict[str, list[int]] = {}  # text → ids, see encode
        if chat_template == "model":  # a vision-language model may keep its template with the processor alone
            self.template = getattr(tokenizer, "chat_template", None) or getattr(processor, "chat_template", None)
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
        if record.images:  # the images open the first user turn, in the content-list form multimodal templates take
            first = next(i for i, turn in enumerate(turns) if turn["role"] == "user")
            parts = [{"type": "image"} for _ in record.images] + [{"type": "text", "text": turns[first]["content"]}]
            turns = [*turns[:first], {**turns[first], "content": parts}, *turns[first + 1 :]]
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

    def inputs(self, record: PromptRecord, tools: list[dict] | None = None) -> tuple[list[int], dict | None]:
        """The prompt's ids and, for a prompt with images, what the model takes for them (the processor's tensors
        and `mm_token_type_ids`, one per id): `GenerateRequest.multimodal`. A group's samples share them (the last
        `_KEEP_IDS` prompts are remembered)."""
        if not record.images:
            return self.encode(record, tools), None
        if self.processor is None:
            raise PromptDataError(
                f"prompt {record.prompt[:60]!r} has {len(record.images)} image(s), but the model has no image "
                "processor (a text model, or a folder without preprocessor/processor config)"
            )
        if self.template is None:
            raise PromptDataError("a prompt with images needs data.chat_template (model, or a Jinja file)")
        text = self.text(record, tools)
        key = (text, tuple(record.images))
        if key not in self._vision:
            from miles_rollout.images import open_image

            images = [
                open_image(data, f"prompt {record.prompt[:60]!r}: image {i}") for i, data in enumerate(record.images)
            ]
            out = self.processor(
                text=[text], images=images, return_tensors="pt", return_mm_token_type_ids=True, add_special_tokens=False
            )
            ids = out["input_ids"][0].tolist()
            multimodal = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
            multimodal["mm_token_type_ids"] = out["mm_token_type_ids"][0].tolist()
            if len(self._vision) >= _KEEP_VISION:
                self._vision.clear()
            self._vision[key] = (ids, multimodal)
        ids, multimodal = self._vision[key]
        return list(ids), dict(multimodal)

    def encode(self, record: PromptRecord, tools: list[dict] | None = None) -> list[int]:
        """The prompt's ids (a prompt with images: `inputs`). A group's samples share their prompt: its text is
        tokenized once (the last `_KEEP_IDS` texts are remembered) and each caller gets its own copy."""
        if record.images:
            return self.inputs(record, tools)[0]
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

    def turn_inputs(
        self, messages: list[dict], tools: list[dict] | None = None, model_end: str = ""
    ) -> tuple[list[int], dict | None]:
        """`turn_ids`, for environment turns that may hold images: a message's content is a text, or a list of parts
        (`{"type": "text", "text": ...}`, `{"type": "image", "image": <bytes of an image file | PIL image>}`). The
        processor renders the turn's text with each image's placeholder expanded and gives their pixel inputs (and
        `mm_token_type_ids`, one per id of the turn); None for a turn without images."""
        images = [part["image"] for m in messages if isinstance(m.get("content"), list) for part in m["content"]
                  if isinstance(part, dict) and part.get("type") == "image"]  # fmt: skip
        if not images:
            return self.turn_ids(messages, tools, model_end), None
        if self.processor is None or self.template is None:
            raise PromptDataError(
                "an environment turn with images needs a vision-language model's processor and data.chat_template"
            )
        text = self._turn_text(messages, tools, model_end)
        from miles_rollout.images import open_image

        decoded = [open_image(bytes(image), "an environment turn's image") if isinstance(image, (bytes, bytearray))
                   else image for image in images]  # fmt: skip
        out = self.processor(
            text=[text], images=decoded, return_tensors="pt", return_mm_token_type_ids=True, add_special_tokens=False
        )
        multimodal = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        multimodal["mm_token_type_ids"] = out["mm_token_type_ids"][0].tolist()
        return out["input_ids"][0].tolist(), multimodal

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
        return self.tokenizer.encode(self._turn_text(messages, tools, model_end), add_special_tokens=False)

    def _turn_text(self, messages: list[dict], tools: list[dict] | None, model_end: str) -> str:
        """What the template writes for environment turns after a model turn (see `turn_ids`)."""
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
        return text


_KEEP_IDS = 4096  # prompt texts whose ids an encoder remembers (a step's prompts, many times over)
_KEEP_VISION = 64  # prompts with images whose inputs an encoder remembers (a real image's pixels are megabytes)
_PLACEHOLDER = "\u2063miles\u2063"  # invisible separators: text no template writes itself
