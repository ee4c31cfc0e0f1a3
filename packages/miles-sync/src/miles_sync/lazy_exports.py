"""Lazy package exports, so `import miles_x.config` never pulls torch in through `miles_x/__init__`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return `__getattr__` and `__dir__` for a package whose names live in submodules.

    `exports` maps an exported name to the submodule (relative to `package`) that defines it.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
