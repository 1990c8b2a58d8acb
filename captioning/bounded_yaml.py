"""YAML for untrusted configuration text, with bounds.

``yaml.safe_load`` constructs no arbitrary objects, but it happily builds a "billion laughs" document: a few
anchors whose aliases refer to each other expand to 10^9 values when anything walks the result (pydantic
validation, an error message's ``repr``) - minutes and tens of GB before the kernel's OOM killer steps in. Deep
nesting ends in a ``RecursionError``. :func:`load` refuses both before anything is built:

- at most ``MAX_ALIASES`` aliases (``*name``) in one document,
- at most ``MAX_NODES`` values once every alias is expanded (counted on the node graph, not by expanding it),
- at most ``MAX_DEPTH`` levels of nesting (aliases expanded too), and no alias inside its own anchor.

A refusal raises :class:`YAMLLimitError` (a ``ValueError``, deliberately not a ``yaml.YAMLError``) whose message
is one line naming the key path and line/column where the bound was crossed. Configurations are a few dozen
values; the bounds are far above any real one.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from captioning.errors import InputError

MAX_ALIASES = 100
MAX_NODES = 100_000
MAX_DEPTH = 64


class YAMLLimitError(InputError, ValueError):
    """A YAML document crosses a bound (aliases, expanded size, depth): the message names where."""


def _where(path: list[str], node: Node | None) -> str:
    key = "".join(p if p.startswith("[") else f".{p}" for p in path).lstrip(".") or "the top level"
    if node is not None and node.start_mark is not None:
        return f"at {key} (line {node.start_mark.line + 1}, column {node.start_mark.column + 1})"
    return f"at {key}"


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts aliases and nesting while composing the node graph."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise YAMLLimitError(f"more than {MAX_ALIASES} YAML aliases (*name) at line {mark.line + 1}, "
                                     f"column {mark.column + 1}: refused (write the values out)")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLLimitError(f"YAML nested deeper than {MAX_DEPTH} levels at line {mark.line + 1}, "
                                     f"column {mark.column + 1}: refused")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _measure(node: Node, path: list[str], memo: dict[int, tuple[int, int]], active: set[int]) -> tuple[int, int]:
    """(values, depth) of ``node`` with every alias expanded, memoised per node: a shared node is counted as
    often as it is referenced without walking it again. Anchors precede their aliases in document order, so an
    alias's target is already measured and the recursion is only as deep as the document's own nesting."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise YAMLLimitError(f"{_where(path, node)}: a YAML alias refers to its own anchor (a cycle): refused")
    active.add(key)
    size, depth = 1, 1
    children: list[tuple[str | None, Node]] = []
    if isinstance(node, SequenceNode):
        children = [(f"[{i}]", c) for i, c in enumerate(node.value)]
    elif isinstance(node, MappingNode):
        for k, v in node.value:
            children.append((None, k))
            children.append((str(k.value) if isinstance(k, ScalarNode) else "?", v))
    for name, child in children:
        s, d = _measure(child, path if name is None else [*path, name], memo, active)
        size += s
        depth = max(depth, d + 1)
        if size > MAX_NODES:
            raise YAMLLimitError(f"{_where(path, node)}: YAML aliases expand to more than {MAX_NODES:,} values "
                                 "(an alias bomb?): refused")
        if depth > MAX_DEPTH:
            raise YAMLLimitError(f"{_where(path, node)}: YAML nested deeper than {MAX_DEPTH} levels once aliases "
                                 "are expanded: refused")
    active.discard(key)
    memo[key] = (size, depth)
    return size, depth


def load(text: str) -> Any:
    """``yaml.safe_load(text)`` within the bounds above; :class:`YAMLLimitError` when it would cross one,
    ``yaml.YAMLError`` for text that is not YAML."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _measure(node, [], {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()
