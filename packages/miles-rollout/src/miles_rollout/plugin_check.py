"""Resolve user code named by a dotted path: `package.module:attribute` or `package.module.attribute`.

Modules are imported from the module search path, extended by the folders in the environment variable
MILES_PLUGIN_DIRS (`miles run` sets it to the job file's folder, for the driver and every Ray worker). They
are appended: a plug-in module never shadows an installed package of the same name.

The resolver lives in `miles_sync.dotted_paths` (every package uses it); this module adds the import-free check a
server uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles_sync.dotted_paths import PLUGIN_DIRS_ENV, plugin_dirs_on_path, resolve_dotted

__all__ = ["PLUGIN_DIRS_ENV", "locate_function", "plugin_dirs_on_path", "resolve_dotted", "resolve_named"]


def resolve_named(name_or_path: str, builtin: Mapping[str, Any], unknown: str) -> Any:
    """`builtin[name_or_path]`, else the object at the dotted path `name_or_path`. A bare name that is neither
    raises ValueError: `unknown` (what is unknown and what is offered), then how to give a dotted path."""
    if name_or_path in builtin:
        return builtin[name_or_path]
    if "." not in name_or_path and ":" not in name_or_path:
        raise ValueError(f"{unknown}, or give a dotted path 'package.module:function'")
    return resolve_dotted(name_or_path)


def locate_function(path: str, positional: int | None = 1, classes: bool = False, coroutine: bool = False) -> str:
    """Check, without importing anything, that `path` names a function defined at the top of its module's source
    (a `def`, not a name imported from elsewhere; an `async def` where `coroutine`; a class too where `classes`)
    that can be called with `positional` arguments (None, or a class: not checked); returns the source file.
    Raises ValueError naming what is wrong.

    What a server uses to accept a plug-in it must not run: importing a module executes it, and may load
    heavy dependencies into the server (the job's driver imports it instead)."""
    import ast
    from importlib.machinery import PathFinder

    plugin_dirs_on_path()
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr.isidentifier():
        raise ValueError(f"{path!r} is not a dotted path like 'package.module:function'")
    search: list[str] | None = None
    spec = None
    parts = module_name.split(".")
    for depth in range(len(parts)):
        name = ".".join(parts[: depth + 1])
        spec = PathFinder.find_spec(name, search)
        if spec is None:
            raise ValueError(f"cannot find module {name!r} of {path!r}")
        search = list(spec.submodule_search_locations or [])
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"module {module_name!r} of {path!r} has no Python source to check")
    tree = ast.parse(open(spec.origin, encoding="utf-8").read(), spec.origin)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == attr:
            if classes:
                return spec.origin
            raise ValueError(f"{path!r} is a class, not a function")
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == attr:
            if coroutine and not isinstance(node, ast.AsyncFunctionDef):
                raise ValueError(f"{path!r} is a plain function, not an async one (async def)")
            if positional is None:
                return spec.origin
            args = node.args
            params = [*args.posonlyargs, *args.args]
            required = len(params) - len(args.defaults)
            if args.vararg is None and len(params) < positional or required > positional:
                raise ValueError(f"{path!r} must take {positional} positional argument(s); it takes {len(params)}")
            return spec.origin
    raise ValueError(f"module {module_name!r} defines no function {attr!r} (a top-level `def`)")
