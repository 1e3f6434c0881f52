"""Source text and positions: a node's code on one line for messages, pre-order spans."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from ampdoctor.lint import helpers as h
from ampdoctor.lint import tree as _tree
from ampdoctor.lint.rule import Context

_EMPTY = cst.Module([])


def code(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node)


def short(node: "cst.CSTNode | str", limit: int = 40) -> str:
    """Source of a node (or a text) on one line, shortened to ``limit`` characters for messages."""
    s = " ".join((node if isinstance(node, str) else code(node)).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def in_nested_scope(ctx: Context, root: cst.CSTNode) -> bool:
    """Whether a def/lambda/class lies between the current node and ``root``."""
    for p in ctx.ancestors():
        if p is root:
            return False
        if isinstance(p, h.SCOPES):
            return True
    return False


def order(root: cst.CSTNode) -> dict[int, tuple[int, int]]:
    """id(node) -> (pre-order index, index of the last node in its subtree), nested scopes
    included, for "does A come before B" questions inside ``root``."""
    out: dict[int, tuple[int, int]] = {}
    counter = 0

    def visit(n: cst.CSTNode) -> None:
        nonlocal counter
        start = counter
        counter += 1
        for c in _tree.children(n):
            visit(c)
        out[id(n)] = (start, counter - 1)

    visit(root)
    return out


def module_calls(node: cst.CSTNode) -> Iterator[cst.Call]:
    for n in h.walk(node):
        if isinstance(n, cst.Call):
            yield n


