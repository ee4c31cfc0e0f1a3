"""Resolve user code named by a dotted path: `package.module:attribute` or `package.module.attribute`."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_dotted(path: str) -> Any:
    """Import and return the object named by `path`; raise ValueError naming what is missing."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} of {path!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr_path!r} (from {path!r})") from None
    return obj
