"""YAML from users and API clients, parsed within bounds: size, nesting depth and nodes after aliases expand.

`yaml.safe_load` alone is not safe for untrusted text: an alias bomb ("billion laughs": nine levels of nine
aliases to the level below) is a few hundred bytes that expand to 9**9 values once anything walks the data (a spec
holding one grew past 2 GB as it was dumped), deep nesting overflows the composer's recursion, and some scalars
(`2024-02-30`) raise ValueError instead of a YAML error. `load_yaml` refuses all of these with a `yaml.YAMLError`
that has a line, so callers report it as any other YAML error."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

# A shipped job spec is under 2 KB with under 100 nodes. PyYAML (pure Python, to count as it composes) takes about
# 25 µs a node: these bounds keep the worst document under a second.
MAX_YAML_CHARS = 1 << 18
MAX_YAML_NODES = 10_000  # counted with every alias expanded
MAX_YAML_DEPTH = 64  # a job spec nests 4 levels; PyYAML's composer recurses ~3 frames per level


class YamlLimitError(yaml.MarkedYAMLError):
    """YAML refused before it is built: too long, nested too deep, or too many nodes once its aliases expand."""


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts, while it composes, the nodes the document would have with its aliases expanded.

    An alias costs the expanded size of the node it names (known once that node is complete), so a document is
    refused as soon as its expansion passes `MAX_YAML_NODES`, before any Python object is built. An alias to a node
    still open (a cycle) is refused too: nothing downstream expects recursive data."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.num_expanded = 0
        self.depth = 0
        self.anchor_sizes: dict[str, int] = {}

    def _count(self, num_nodes: int, mark: Any) -> None:
        self.num_expanded += num_nodes
        if self.num_expanded > MAX_YAML_NODES:
            raise YamlLimitError(
                problem=f"more than {MAX_YAML_NODES} values, each alias (*name) counted as all it stands for",
                problem_mark=mark,
            )

    def fetch_flow_collection_start(self, token_class: Any) -> None:
        # the scanner looks ahead over every open flow collection for each token: "[" * 5000 took seconds to scan
        # before the composer saw the node past the limit
        if self.flow_level >= MAX_YAML_DEPTH:
            raise YamlLimitError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels", problem_mark=self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.anchors and event.anchor not in self.anchor_sizes:
                raise YamlLimitError(problem=f"alias *{event.anchor} refers to itself", problem_mark=event.start_mark)
            self._count(self.anchor_sizes.get(event.anchor, 0), event.start_mark)
            return super().compose_node(parent, index)  # an undefined alias: PyYAML's own error
        self.depth += 1
        if self.depth > MAX_YAML_DEPTH:
            raise YamlLimitError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels", problem_mark=event.start_mark)
        start = self.num_expanded
        self._count(1, event.start_mark)
        node = super().compose_node(parent, index)
        self.depth -= 1
        if event.anchor is not None:
            self.anchor_sizes[event.anchor] = self.num_expanded - start
        return node

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        # SafeConstructor raises plain exceptions on some scalars: `9999…` (5000 digits) and `2024-02-30` ValueError,
        # `!!int ""` IndexError, `!!timestamp x` AttributeError; report them as YAML errors at the node's line
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # noqa: BLE001 - turned into a YAML error, not swallowed
            raise ConstructorError(None, None, f"cannot read this value ({exc})", node.start_mark) from None


def _checked_length(text: str) -> str:
    if len(text) > MAX_YAML_CHARS:
        raise YamlLimitError(problem=f"{len(text)} characters is over the limit of {MAX_YAML_CHARS}")
    return text


def load_yaml(text: str) -> Any:
    """The one document in `text`, as plain Python data (SafeLoader's types), or a `yaml.YAMLError`."""
    loader = BoundedLoader(_checked_length(text))
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def compose_yaml(text: str) -> yaml.Node | None:
    """The node tree of the one document in `text` (with lines, for pointing at fields), within the same bounds."""
    loader = BoundedLoader(_checked_length(text))
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()
