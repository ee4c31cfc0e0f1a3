"""MkDocs hook: the configuration reference, generated at build time from the job spec's pydantic models.

`docs/configuration.md` holds the placeholder below; this hook replaces it with one section per model reachable
from `miles_control.spec.config.JobSpec` (the models of miles_rollout.config, miles_train.config and miles_sync.config
that it composes), each a table of field, type, default and description. A section's intro is the model's
docstring, a field's description its `Field(description=...)`. A discriminated union (`model`, `rollout.engine`,
`train.backend`, `sync`, `schedule`) gets one section that lists its variants, the fields their common base
holds, and a subsection per variant with the fields only it has.

The config modules import only pydantic, so this runs without torch. They are imported from this checkout's
`packages/*/src`, so the page describes the code it is built with.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLACEHOLDER = "<!-- config-reference -->"
ROOT = Path(__file__).resolve().parents[2]

# Constraint metadata of pydantic fields (annotated_types), as a reader writes it.
_BOUNDS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}


CONFIG_MODULES = ("miles_sync.config", "miles_rollout.config", "miles_train.config", "miles_control.spec.config")


def _import_job_spec() -> type:
    for src in sorted(ROOT.glob("packages/*/src"), reverse=True):
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
    for name in CONFIG_MODULES:  # `mkdocs serve` builds again in the same process: read edits to the models
        module = sys.modules.get(name)
        module = importlib.reload(module) if module is not None else importlib.import_module(name)
    return module.JobSpec


def _is_model(tp: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _unwrap(tp: Any) -> Any:
    """The type inside `Annotated[...]`."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    tp = _unwrap(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(_unwrap(arg) for arg in typing.get_args(tp))
    return None


def _literal_values(tp: Any) -> tuple[Any, ...] | None:
    tp = _unwrap(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


def _tag_field(variants: list[type]) -> str:
    """The field that tells the variants of a union apart: one each declares as a single-value Literal."""
    for name in variants[0].model_fields:
        if all(
            name in v.model_fields and len(_literal_values(v.model_fields[name].annotation) or ()) == 1
            for v in variants
        ):
            return name
    raise ValueError(f"no discriminator field common to {[v.__name__ for v in variants]}")


def _tag(model: type, tag_field: str) -> str:
    return str(_literal_values(model.model_fields[tag_field].annotation)[0])  # type: ignore[index]


def _anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "job-spec"


def _escape(text: str) -> str:
    """Markdown-safe text for a table cell or paragraph, keeping `code spans` as they are."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    out = []
    for i, part in enumerate(parts):
        if i % 2:  # a code span: only a pipe would end the table cell
            out.append(part.replace("|", "\\|"))
            continue
        part = re.sub(r"\bNone\b", "`null`", part)  # the code's None is a spec's null
        part = part.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        for char in "\\*_[]|":
            part = part.replace(char, "\\" + char)
        out.append(part)
    return "".join(out)


def _docstring(model: type) -> str:
    doc = model.__dict__.get("__doc__")
    return _escape(inspect.cleandoc(doc)) if doc else ""


@dataclass
class Section:
    """One model of the spec, at the path where it is used."""

    path: str
    model: type
    variants: list[type] = field(default_factory=list)  # a discriminated union: its models
    tag_field: str = ""


class Reference:
    def __init__(self, root_model: type) -> None:
        self.sections: list[Section] = []
        self.anchors: dict[type, str] = {}  # model → the anchor of its section (or variant subsection)
        self.paths: dict[type, str] = {}  # model → where it sits in a spec
        self._collect(root_model, "")

    # --- the walk -----------------------------------------------------------------------------------------

    def _collect(self, model: type, path: str) -> None:
        self.sections.append(Section(path, model))
        self.anchors[model] = _anchor(path)
        self.paths[model] = path
        for name, info in model.model_fields.items():
            self._collect_type(info.annotation, f"{path}.{name}" if path else name)

    def _collect_type(self, tp: Any, path: str) -> None:
        args = _union_args(tp)
        models = [arg for arg in (args or (_unwrap(tp),)) if _is_model(arg)]
        if not models:
            for inner in typing.get_args(_unwrap(tp)):  # list[Model], dict[str, Model], list[a union of models]
                if any(_is_model(arg) for arg in _union_args(inner) or ()):
                    self._collect_type(inner, path)
                elif _is_model(inner) and inner not in self.anchors:
                    self._collect(inner, path)
            return
        if len(models) == 1:
            if models[0] not in self.anchors:
                self._collect(models[0], path)
            return
        tag_field = _tag_field(models)
        section = Section(path, models[0], variants=models, tag_field=tag_field)
        self.sections.append(section)
        for variant in models:
            self.anchors[variant] = _anchor(f"{path}-{_tag(variant, tag_field)}")
            self.paths[variant] = path
            for name, info in variant.model_fields.items():
                self._collect_type(info.annotation, f"{path}.{name}")

    # --- rendering ------------------------------------------------------------------------------------------

    def link(self, model: type, text: str | None = None) -> str:
        return f"[{text or '`' + self.paths[model] + '`'}](#{self.anchors[model]})"

    def type_text(self, tp: Any) -> str:
        """A field's type as a reader writes it: plain names for types, `code` for the values it may take."""
        tp = _unwrap(tp)
        args = _union_args(tp)
        if args is not None:
            models = [a for a in args if _is_model(a)]
            if len(models) > 1:
                tag_field = _tag_field(models)
                choices = ", ".join(self.link(m, f"`{_tag(m, tag_field)}`") for m in models)
                text = f"one of {choices} (by `{tag_field}`)"
                rest = [a for a in args if not _is_model(a)]
            else:
                text, rest = "", list(args)
            values = [v for a in rest for v in _literal_values(a) or ()]  # Literal[...] | Literal[...]: one list
            parts = [self.type_text(a) for a in rest if a is not type(None) and _literal_values(a) is None]
            parts += [f"`{_yaml(v)}`" for v in values] + (["`null`"] if type(None) in args else [])
            return _or([text, *parts])
        values = _literal_values(tp)
        if values is not None:
            return _or([f"`{_yaml(v)}`" for v in values])
        if _is_model(tp):
            return self.link(tp)
        if tp is typing.Any:
            return "any"
        origin, inner = typing.get_origin(tp), typing.get_args(tp)
        if origin in (list, typing.List):  # noqa: UP006 (annotations may spell it either way)
            return f"list of {self.type_text(inner[0])}" if inner else "list"
        if origin in (dict, typing.Dict):  # noqa: UP006
            return f"mapping of {self.type_text(inner[0])} to {self.type_text(inner[1])}" if inner else "mapping"
        if origin is tuple:
            return "[" + ", ".join(self.type_text(a) for a in inner) + "]"
        return getattr(tp, "__name__", str(tp))

    def bounds(self, info: Any) -> str:
        found = []
        for meta in info.metadata:
            for attr, sign in _BOUNDS.items():
                if getattr(meta, attr, None) is not None:
                    found.append(f"{sign} {_yaml(getattr(meta, attr))}")
            if getattr(meta, "min_length", None):
                found.append(f"length ≥ {meta.min_length}")
            if getattr(meta, "max_length", None) is not None:
                found.append(f"length ≤ {meta.max_length}")
        return ", ".join(found)

    def default_text(self, name: str, info: Any) -> str:
        if info.is_required():
            return "**required**"
        factory = info.default_factory
        if factory is not None:
            if _is_model(factory):
                variants = _union_args(info.annotation)
                models = [m for m in variants or () if _is_model(m)]
                if len(models) > 1:
                    tag_field = _tag_field(models)
                    return f"`{{{tag_field}: {_tag(factory, tag_field)}}}`"
                return "`{}`"
            value = factory()
            if _is_model(type(value)):  # chosen at run time: the factory says how
                return _escape(inspect.cleandoc(factory.__doc__ or factory.__name__))
        else:
            value = info.default
        text = f"`{_yaml(value)}`"
        if name.endswith("_bytes") and isinstance(value, int) and value and value % 2**20 == 0:
            text += f" ({value // 2**20} MiB)"
        return text

    def table(self, fields: dict[str, Any]) -> str:
        rows = ["| field | type | default | description |", "|---|---|---|---|"]
        for name, info in fields.items():
            kind = self.type_text(info.annotation)
            bounds = self.bounds(info)
            if bounds:
                kind += f" ({bounds})"
            description = _escape(info.description or "")
            rows.append(f"| `{name}` | {kind} | {self.default_text(name, info)} | {description} |")
        return "\n".join(rows)

    def render(self) -> str:
        out: list[str] = []
        for section in self.sections:
            title = f"`{section.path}`" if section.path else "The job spec"
            if not section.variants:
                out += [f"## {title} {{#{_anchor(section.path)}}}", ""]
                out += [_docstring(section.model), ""] if _docstring(section.model) else []
                out += [self.table(section.model.model_fields), ""]
                continue
            out += self.render_union(section, title)
        return "\n".join(out)

    def render_union(self, section: Section, title: str) -> list[str]:
        variants, tag_field = section.variants, section.tag_field
        choices = ", ".join(self.link(v, f"`{_tag(v, tag_field)}`") for v in variants)
        out = [f"## {title} {{#{_anchor(section.path)}}}", ""]
        out += [f"One model per `{tag_field}`: {choices}. A field of another kind is refused by name.", ""]
        base = _common_base(variants)
        shared = {n: i for n, i in base.model_fields.items() if n != tag_field} if base is not None else {}
        if shared:
            out += [_docstring(base) or "Fields every kind has.", "", self.table(shared), ""]
        for variant in variants:
            tag = _tag(variant, tag_field)
            out += [f"### `{section.path}` with `{tag_field}: {tag}` {{#{self.anchors[variant]}}}", ""]
            doc = _docstring(variant)
            out += [doc, ""] if doc else []
            own = {n: i for n, i in variant.model_fields.items() if n != tag_field and n not in shared}
            out += [self.table(own), ""] if own else ["No fields of its own.", ""]
        return out


def _common_base(variants: list[type]) -> type | None:
    """The most derived model class every variant inherits from that declares fields, if any."""
    for cls in variants[0].__mro__:
        if _is_model(cls) and all(issubclass(v, cls) for v in variants) and cls.model_fields:
            return cls
    return None


def _or(parts: list[str]) -> str:
    """`a`, `b` or `c`."""
    parts = [p for p in parts if p]
    return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else "".join(parts)


def _yaml(value: Any, inner: bool = False) -> str:
    """A default or allowed value as it is written in a YAML spec (strings quoted inside a list)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(v, inner=True) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str) and inner:
        return json.dumps(value)
    return str(value)


def config_reference() -> str:
    """The generated Markdown of the whole reference."""
    return Reference(_import_job_spec()).render()


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if PLACEHOLDER not in markdown:
        return markdown
    return markdown.replace(PLACEHOLDER, config_reference())
