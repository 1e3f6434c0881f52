"""A fast walk over the meaningful nodes of a libcst tree.

libcst's own ``visit``/``children`` rebuild every node as they go, which costs about as much
as parsing. The linter only reads the tree, so it walks the dataclass fields directly, in
source order, and skips pure trivia (whitespace, commas, brackets, operators' tokens, comments).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Iterator

import libcst as cst

_TRIVIA = frozenset({
    "lpar", "rpar", "comma", "colon", "first_colon", "second_colon", "semicolon", "dot", "equal",
    "lbrace", "lbracket", "rbrace", "rbracket", "leading_lines", "lines_after_decorators",
    "trailing_whitespace", "header", "footer", "newline", "empty_lines", "leading_whitespace",
    "asynchronous", "default_indent", "default_newline", "encoding", "has_trailing_newline",
    "indent", "posonly_ind", "star", "trailing_comma", "operator", "relative", "comment",
})

# fields whose declaration order differs from the order they appear in the source
_ORDER = {
    "FunctionDef": ("decorators", "name", "type_parameters", "params", "returns", "body"),
    "ClassDef": ("decorators", "name", "type_parameters", "bases", "keywords", "body"),
    "IfExp": ("body", "test", "orelse"),
    "Arg": ("keyword", "value"),
    "ExceptHandler": ("type", "name", "body"),
    "ExceptStarHandler": ("type", "name", "body"),
}


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out.add(sub)
        out |= _subclasses(sub)
    return out


# exact-type membership is much cheaper than isinstance() against libcst's abstract base
NODE_TYPES = frozenset(_subclasses(cst.CSTNode))


@lru_cache(maxsize=None)
def _fields(cls: type) -> tuple[str, ...]:
    if cls.__name__ in _ORDER:
        declared = {f.name for f in dataclasses.fields(cls)}
        return tuple(n for n in _ORDER[cls.__name__] if n in declared)
    return tuple(f.name for f in dataclasses.fields(cls)
                 if not f.name.startswith("whitespace") and f.name not in _TRIVIA)


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    out: list[cst.CSTNode] = []
    types = NODE_TYPES
    for name in _fields(type(node)):
        value = getattr(node, name)
        t = type(value)
        if t in types:
            out.append(value)
        elif t is tuple or t is list:
            out.extend(v for v in value if type(v) in types)
    return out


def walk(node: cst.CSTNode, *, skip: tuple[type, ...] = ()) -> Iterator[cst.CSTNode]:
    """Descendants of ``node`` in source order (``node`` excluded), not entering ``skip`` types."""
    stack = list(reversed(children(node)))
    while stack:
        n = stack.pop()
        yield n
        if skip and isinstance(n, skip):
            continue
        stack.extend(reversed(children(n)))
