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


SERVER_CHOSEN = (("output_dir",), ("sync", "dir"), ("sync", "master_address"), ("sync", "master_port"), ("store",))
"""Fields a job over the API leaves to the server: a clone of a stored spec leaves them out."""


def clone_spec(spec: dict) -> dict:
    """An earlier job's stored spec (defaults filled in) as a spec to launch again: without what the server
    chose for it, named "<name>-again"."""
    data = yaml.safe_load(yaml.safe_dump(spec))  # a deep copy
    for path in SERVER_CHOSEN:
        node = data
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    data["name"] = f"{data.get('name', 'job')}-again"
    return data


def numbered(text: str, marks: dict[int, str]) -> str:
    """The YAML with its line numbers, and `# <- message` after each line in `marks` (1-based)."""
    lines = text.splitlines() or [""]
    width = len(str(len(lines)))
    out = []
    for number, line in enumerate(lines, 1):
        mark = f"   # <- {marks[number]}" if number in marks else ""
        out.append(f"{number:>{width}} {'>' if number in marks else ' '} {line}{mark}")
    return "\n".join(out)


NOT_CONFIG = ("name", "output_dir", "store")  # differ between any two runs and change nothing they compute


def flatten(spec: dict, prefix: str = "") -> dict[str, object]:
    """`a.b.c` → value for every leaf of a nested spec (lists are leaves)."""
    out: dict[str, object] = {}
    for key, value in spec.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def spec_diff(specs: dict[str, dict]) -> list[dict[str, object]]:
    """The fields whose values differ between the runs' specs (a field one run lacks shows as None), one row
    per field: {"field": path, label: value, ...}; names, output folders and stores left out."""
    flat = {label: flatten(spec) for label, spec in specs.items()}
    fields = sorted({f for leaves in flat.values() for f in leaves if f.split(".")[0] not in NOT_CONFIG})
    rows = []
    for field in fields:
        values = [leaves.get(field) for leaves in flat.values()]
        if any(v != values[0] for v in values[1:]):
            rows.append(
                {
                    "field": field,
                    **{label: repr(v) if v is not None else None for label, v in zip(flat, values, strict=True)},
                }
            )
    return rows


def beyond_schedule(rows: list[dict[str, object]]) -> list[str]:
    """The differing fields that are not the schedule's: a comparison of schedules is fair only without them."""
    return [str(r["field"]) for r in rows if not str(r["field"]).startswith("schedule.")]
