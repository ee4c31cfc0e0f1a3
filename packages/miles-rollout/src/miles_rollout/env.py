"""The environment protocol of multi-turn episodes, and the tool-call formats the episode runner parses.

An environment is any object with `reset(record)` and `step(action)` (plain or `async` methods) and an optional
`tools` list; `rollout.environment` names a factory by dotted path (a class, or a function), called with
`rollout.environment_args` as keyword arguments for every episode: one environment per episode, never shared.

- `reset(record) -> str | list[dict] | None`: the first observation. None: the prompt record is the first
  observation; a text: the prompt (one user turn with a chat template); a list of {role, content}: the conversation.
- `step(action) -> StepResult`: the model's turn as an `Action` (its text, and the tool call parsed from it when
  there is one); the environment answers with an observation (a text, or messages), a reward and `done`.
- `tools` (optional): tool schemas in the OpenAI function format, rendered by the chat template.

`rollout.multi_turn.tool_format` says how a tool call is written: `hermes` (Qwen2.5, Hermes: a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`), `xml` (`<call>TEXT</call>`, the
built-in chat model's: the text is the call's `arguments["input"]` and its name is "call"), or none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from miles_rollout.plugin_check import resolve_dotted
from miles_rollout.types import PromptRecord

ToolFormat = Literal["none", "hermes", "xml"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Action:
    """A model turn as the environment receives it."""

    text: str
    tool_call: ToolCall | None = None


@dataclass
class StepResult:
    """The environment's answer. `observation`: a text (a `tool` turn after a tool call, else a `user` turn) or a
    list of {role, content} messages, whose content may be a list of parts for a vision-language model (`{"type":
    "text", "text": ...}`, `{"type": "image", "image": <bytes of an image file | PIL image>}`: a screenshot);
    None or "" with done=True ends the episode without a further turn.
    `reward` adds to the episode's (`metadata["episode"]["env_reward"]`, scored by the `env` reward)."""

    observation: str | list[dict[str, Any]] | None = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def reset(self, record: PromptRecord) -> Any: ...

    def step(self, action: Action) -> Any: ...


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_XML = re.compile(r"<call>(.*?)</call>", re.DOTALL)


def parse_tool_call(text: str, tool_format: ToolFormat) -> ToolCall | None:
    """The first tool call written in `text`, or None (no call, or one that does not parse: the environment then
    sees the text alone and can answer that the call was malformed)."""
    if tool_format == "hermes":
        match = _HERMES.search(text)
        if match is None:
            return None
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        return ToolCall(call["name"], arguments) if isinstance(arguments, dict) else None
    if tool_format == "xml":
        match = _XML.search(text)
        return None if match is None else ToolCall("call", {"input": match.group(1)})
    return None


def environment_factory(path: str, args: dict[str, Any] | None = None):
    """A function making one environment per call, from `rollout.environment` and `rollout.environment_args`;
    ValueError naming the path when it cannot be imported, is not callable, or makes something that is not an
    environment (checked on the first one made)."""
    factory = resolve_dotted(path)
    if not callable(factory):
        raise ValueError(f"rollout.environment: {path!r} resolves to a {type(factory).__name__}, not a callable")
    kwargs = dict(args or {})
    checked = False

    def make():
        nonlocal checked
        try:
            env = factory(**kwargs)
        except TypeError as exc:
            raise ValueError(f"rollout.environment: calling {path!r} with {sorted(kwargs)} failed: {exc}") from exc
        if not checked:
            missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
            if missing:
                raise ValueError(
                    f"rollout.environment: {path!r} made a {type(env).__name__} without {' and '.join(m + '()' for m in missing)}: "
                    "an environment has reset(record) and step(action)"
                )
            checked = True
        return env

    return make
