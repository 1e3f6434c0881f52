"""Building replacement code for fixes."""

from __future__ import annotations

import libcst as cst

from ampdoctor.lint.names import Names


def torch_local(names: Names) -> tuple[str, tuple[str, ...]]:
    """The local name of the torch module and the imports a fix needs to use it."""
    local = names.local_name_for("torch")
    if local is not None:
        return local, ()
    return "torch", ("torch",)


def attr_chain(dotted: str) -> cst.BaseExpression:
    """``a.b.c`` -> the Attribute chain."""
    parts = dotted.split(".")
    node: cst.BaseExpression = cst.Name(parts[0])
    for p in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(p))
    return node


def string(value: str) -> cst.SimpleString:
    return cst.SimpleString(f'"{value}"')


