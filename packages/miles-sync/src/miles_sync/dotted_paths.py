"""Resolve user code named by a dotted path: `package.module:attribute` or `package.module.attribute`.

Modules are imported from the module search path, extended by the folders in the environment variable
MILES_PLUGIN_DIRS (`miles run` sets it to the job file's folder, for the driver and every Ray worker). They
are appended: a plug-in module never shadows an installed package of the same name.

Here, at the bottom of the package stack, so that every package (the trainer's objectives, the rollout's
rewards and environments) resolves plug-ins the same way.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

PLUGIN_DIRS_ENV = "MILES_PLUGIN_DIRS"


def plugin_dirs_on_path() -> None:
    """Append the folders of MILES_PLUGIN_DIRS to `sys.path` (once each)."""
    added = False
    for folder in os.environ.get(PLUGIN_DIRS_ENV, "").split(os.pathsep):
        if folder and folder not in sys.path:
            sys.path.append(folder)
            added = True
    if added:
        importlib.invalidate_caches()


def resolve_dotted(path: str) -> Any:
    """Import and return the object named by `path`; raise ValueError naming what is missing."""
    plugin_dirs_on_path()
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
