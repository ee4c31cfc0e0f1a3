"""Job specs in the launch form: YAML in, and the API's field errors placed on the YAML's lines."""

from __future__ import annotations

import yaml


class SpecSyntaxError(ValueError):
    pass


def parse_yaml(text: str) -> dict:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise SpecSyntaxError(f"{where}{getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict):
        raise SpecSyntaxError(f"a job spec is a mapping of fields, not a {type(data).__name__}")
    return data


def field_line(text: str, path: str) -> int | None:
    """The 1-based line of `path` (e.g. `rollout.sampling.top_p`) in the YAML, or of its nearest parent."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in path.split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        for key_node, value_node in node.value:
            if key_node.value == key:
                line, node = key_node.start_mark.line + 1, value_node
                break
        else:
            break
    return line
