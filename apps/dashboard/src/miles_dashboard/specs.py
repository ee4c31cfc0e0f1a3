"""Job specs in the launch form: YAML in, and the API's field errors placed on the YAML's lines."""

from __future__ import annotations

import copy

import yaml

from miles_control.spec.yaml_safe import compose_yaml, load_yaml


class SpecSyntaxError(ValueError):
    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line  # 1-based, where the parser stopped


def parse_yaml(text: str) -> dict:
    try:
        data = load_yaml(text) or {}  # bounded: a pasted alias bomb is refused, not expanded
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        line = mark.line + 1 if mark else None
        raise SpecSyntaxError(f"{where}{getattr(exc, 'problem', None) or exc}", line) from None
    if not isinstance(data, dict):
        raise SpecSyntaxError(f"a job spec is a mapping of fields, not a {type(data).__name__}")
    return data


LINE_PX, PAD_PX, GUTTER_PX = 21, 8, 44  # the editor's line height, top padding and the numbers' column


def gutter_css(key: str, num_lines: int, marks: dict[int, str] | set[int]) -> str:
    """A `<style>` that gives the text area of widget `key` an editor's gutter: line numbers, and the lines in
    `marks` (1-based) shaded red across the editor with their numbers in bold red. The gutter is the text area's own
    background (an SVG that scrolls with the text: `background-attachment: local`), so it stays aligned while one
    types; the lines do not wrap (one row per YAML line) and the text is monospaced at a fixed line height."""
    import base64

    rows = max(num_lines, 1) + 40  # room for the lines one adds before the next rerun
    parts = [f'<rect x="0" y="0" width="{GUTTER_PX - 6}" height="{PAD_PX * 2 + rows * LINE_PX}" fill="#f0f2f6"/>']
    for n in range(1, rows + 1):
        top = PAD_PX + (n - 1) * LINE_PX
        if n in marks:
            parts.append(f'<rect x="0" y="{top}" width="4000" height="{LINE_PX}" fill="#ffd9d9"/>')
        style = 'fill="#d62728" font-weight="bold"' if n in marks else 'fill="#8a8d93"'
        parts.append(
            f'<text x="{GUTTER_PX - 12}" y="{top + 15}" text-anchor="end" font-family="monospace" font-size="12" '
            f"{style}>{n}</text>"
        )
    height = PAD_PX * 2 + rows * LINE_PX
    svg = f'<svg xmlns="http://www.w3.org/2000/svg" width="4000" height="{height}">{"".join(parts)}</svg>'
    url = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()
    return (
        f"<style>.st-key-{key} textarea {{"
        f"font-family: 'Source Code Pro', ui-monospace, monospace !important; font-size: 14px !important; "
        f"line-height: {LINE_PX}px !important; padding: {PAD_PX}px 8px {PAD_PX}px {GUTTER_PX}px !important; "
        "white-space: pre !important; overflow-wrap: normal !important; overflow-x: auto !important; "
        f'background-image: url("{url}") !important; background-repeat: no-repeat !important; '
        "background-attachment: local !important; background-position: 0 0 !important;}</style>"
    )


def field_line(text: str, path: str) -> int | None:
    """The 1-based line of `path` (e.g. `rollout.sampling.top_p`) in the YAML, or of its nearest parent."""
    try:
        node = compose_yaml(text)
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
    chose for it, named "<name>-again" on its first line, its sections in the spec's own order (not sorted)."""
    data = copy.deepcopy(spec)
    for path in SERVER_CHOSEN:
        node = data
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    name = f"{data.pop('name', 'job')}-again"
    return {"name": name, **data}


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
