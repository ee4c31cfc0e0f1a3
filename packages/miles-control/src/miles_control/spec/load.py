"""Load a job spec from YAML with `--set path.to.field=value` overrides; errors name the field. A relative path in
the file is taken from the file's folder, one in a `--set` value from the working directory."""

from __future__ import annotations

import difflib
import functools
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from miles_control.spec.config import JobSpec
from miles_control.spec.paths import path_values, resolve_relative
from miles_control.spec.yaml_safe import MAX_YAML_CHARS, load_yaml


class SpecError(ValueError):
    """An unusable job spec. `errors` holds one `field.path: reason` line per problem."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.source = source
        self.errors = errors
        super().__init__(f"invalid job spec {source}:\n" + "\n".join(f"  {e}" for e in errors))


@functools.cache
def _defaults() -> dict[str, Any]:
    return JobSpec.model_validate({"name": "defaults"}).model_dump(mode="json")


def _default_type(keys: list[str]) -> str | None:
    """The `type` of the default at `keys` when it is one of several kinds (e.g. `train.backend`: fsdp2)."""
    node: Any = _defaults()
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node.get("type") if isinstance(node, dict) else None


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Set `a.b.c=value` in nested dicts; the value is parsed as YAML (so 3, 0.5, true, [1] work), within the
    bounds of `load_yaml`; a value that is not YAML is a `SpecError` naming the override.

    A section the file leaves out starts as its default's kind: `train.backend.world_size=2` on a file
    without `train.backend` sets the default backend's (fsdp2's) world_size."""
    path, sep, raw = assignment.partition("=")
    if not sep or not path:
        raise SpecError("--set", [f"{assignment!r}: expected path.to.field=value"])
    keys = path.strip().split(".")
    node = data
    for depth, key in enumerate(keys[:-1]):
        if key not in node and (kind := _default_type(keys[: depth + 1])) is not None:
            node[key] = {"type": kind}
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise SpecError("--set", [f"{path}: {key!r} is a value, not a section"])
        node = child
    try:
        node[keys[-1]] = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise SpecError("--set", [f"{assignment!r}: invalid YAML ({getattr(exc, 'problem', None) or exc})"]) from None


def input_loc(loc: tuple[Any, ...] | list[Any], data: Any, error_type: str = "") -> tuple[Any, ...]:
    """An error location as the input spells it: pydantic puts the tag of a discriminated union into the path
    (`schedule.fully_async.max_staleness`, `sync.disk.dir`); the user wrote `schedule.max_staleness`. A path
    element that is not a key of the mapping it indexes is such a tag and is dropped (but the last element of a
    `missing` error, the field that is missing)."""
    out: list[Any] = []
    current = data
    for index, part in enumerate(loc):
        missing = error_type == "missing" and index == len(loc) - 1
        inner = index < len(loc) - 1  # a step into a value: a union's tag that is also a field (`model.path`) is not
        if (
            isinstance(current, dict)
            and not missing
            and (part not in current or (inner and not isinstance(current[part], dict | list)))
        ):
            continue  # a union's tag
        out.append(part)
        if isinstance(current, dict):
            current = current.get(part)
        elif isinstance(current, list) and isinstance(part, int) and 0 <= part < len(current):
            current = current[part]
        else:
            current = None
    return tuple(out)


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation can hold (through Optional, unions, Annotated, lists, dicts)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models(arg)
    return found


def _tag(model: type[BaseModel]) -> Any:
    """The literal that names `model` in a discriminated union (`type: fully_async`, `source: path`), or None."""
    for field in model.model_fields.values():
        if typing.get_origin(field.annotation) is typing.Literal:
            return typing.get_args(field.annotation)[0]
    return None


def _close(name: str, names: set[str]) -> str | None:
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)  # the closest, by difflib's ratio
    return close[0] if close else None


def hint(loc: tuple[Any, ...] | list[Any], root: type[BaseModel] | None = None) -> str | None:
    """For an unknown field at pydantic's error location `loc` (tags of discriminated unions included): the
    closest field its section has ("did you mean ..."), or, where the section is one kind of several, the kinds
    the field belongs to; None when nothing is close."""
    if not loc:
        return None
    current: list[type[BaseModel]] = [root or JobSpec]
    others: list[type[BaseModel]] = []  # the union's other kinds, when the last step chose one by its tag
    for part in loc[:-1]:
        # after a field that holds one of several kinds, pydantic's location names the kind (its tag)
        if len(current) > 1 and (chosen := [m for m in current if _tag(m) == part]):
            current, others = chosen, [m for m in current if _tag(m) != part]
        elif fields := [m.model_fields[part] for m in current if part in m.model_fields]:
            current, others = [m for f in fields for m in _models(f.annotation)], []
        if not current:
            return None
    key = str(loc[-1])
    if owners := [m for m in others if key in m.model_fields]:
        kinds = ", ".join(str(_tag(m)) for m in owners)
        return f"{key!r} is a field of {kinds}, not of {_tag(current[0])}"
    own = {n for m in current for n in m.model_fields}
    if (near := _close(key, own | {n for m in others for n in m.model_fields})) is None:
        return None
    if near in own:
        return f"did you mean {near!r}?"
    kinds = ", ".join(str(_tag(m)) for m in others if near in m.model_fields)
    return f"did you mean {near!r} (a field of {kinds}, not of {_tag(current[0])})?"


def explain(err: Any, root: type[BaseModel] | None = None) -> str:
    """A pydantic error's message, with a hint for an unknown field that is a near miss or another kind's."""
    if err["type"] == "extra_forbidden" and (text := hint(err["loc"], root)) is not None:
        return f"{err['msg']}; {text}"
    return err["msg"]


def _kinds_at(loc: tuple[Any, ...] | list[Any], root: type[BaseModel]) -> list[type[BaseModel]]:
    """The kinds of the discriminated union that the section at `loc` holds (more than one), else []."""
    current = [root]
    for part in loc:
        fields = [m.model_fields[part] for m in current if part in m.model_fields]
        if fields:
            current = [m for f in fields for m in _models(f.annotation)]
        elif not isinstance(part, int):  # a list index stays on the list's item kinds
            return []
    return current if len(current) > 1 else []


def kind_errors(err: Any, data: Any, root: type[BaseModel] | None = None) -> list[dict[str, Any]]:
    """For a section whose kind (`type`, `source`, `transport`) is not one of its union's: the errors its other
    fields have under every kind, which the wrong tag would otherwise hide (a `num_steps: -1` beside
    `type: syncc`); pydantic-shaped, located in the whole spec. [] for any other error."""
    if err.get("type") != "union_tag_invalid":
        return []
    loc, section = tuple(err["loc"]), data
    for part in loc:
        section = section.get(part) if isinstance(section, dict) else None
    kinds = _kinds_at(loc, root or JobSpec)
    tag_field = str((err.get("ctx") or {}).get("discriminator", "")).strip("'")
    if not isinstance(section, dict) or not kinds or not tag_field:
        return []
    common: set[tuple[tuple[Any, ...], str, str]] | None = None
    for kind in kinds:
        try:
            kind.model_validate({**section, tag_field: _tag(kind)})
            return []  # valid under some kind: nothing but the tag is wrong
        except ValidationError as exc:
            found = {(tuple(e["loc"]), e["type"], e["msg"]) for e in exc.errors() if e["type"] != "extra_forbidden"}
        common = found if common is None else common & found
    return [{"loc": (*loc, *where), "type": kind, "msg": msg} for where, kind, msg in sorted(common or set(), key=str)]


def format_validation_error(exc: ValidationError, data: Any = None) -> list[str]:
    """One line per error, `field.path: message`, the path as written in `data` (the validated input); a section of
    a wrong kind also gets the errors its other fields have under every kind (`kind_errors`)."""
    lines = []
    for err in exc.errors():
        for one in [err, *kind_errors(err, data)]:
            where = ".".join(str(p) for p in input_loc(one["loc"], data, one["type"])) or "(top level)"
            lines.append(f"{where}: {explain(one)}")
    return lines


def parse_spec(data: Any, source: str = "<spec>") -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError(source, [f"(top level): expected a mapping, got {type(data).__name__}"])
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(source, format_validation_error(exc, data)) from None


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    path = Path(path)
    if not path.exists():
        raise SpecError(str(path), ["no such file"])
    if path.is_dir():
        raise SpecError(str(path), ["is a folder, not a job spec (a YAML file)"])
    try:
        with path.open("rb") as file:  # at most one byte past the limit: the path may be a device or a pipe
            raw = file.read(MAX_YAML_CHARS + 1)
    except OSError as exc:
        raise SpecError(str(path), [f"cannot read it: {exc.strerror or exc}"]) from None
    if len(raw) > MAX_YAML_CHARS:
        raise SpecError(str(path), [f"longer than the limit of {MAX_YAML_CHARS} bytes for a job spec"])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SpecError(str(path), [f"line {line}: not UTF-8 text (byte {exc.start})"]) from None
    try:
        data = load_yaml(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(whole file)"
        raise SpecError(str(path), [f"{where}: invalid YAML ({getattr(exc, 'problem', None) or exc})"]) from None
    if not isinstance(data, dict):
        raise SpecError(str(path), [f"(top level): expected a mapping, got {type(data).__name__}"])
    # Relative paths of the file are the file's (its data beside it, wherever `miles run` starts); a `--set` value
    # is the command line's, so relative to the working directory.
    resolve_relative(data, path.resolve().parent)
    for assignment in overrides:
        before = {loc: node[key] for loc, node, key, _ in path_values(data)}
        apply_override(data, assignment)
        changed = {loc for loc, node, key, _ in path_values(data) if before.get(loc) != node[key]}
        resolve_relative(data, Path.cwd(), only=changed)
    return parse_spec(data, str(path))
