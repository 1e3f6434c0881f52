"""Small CST helpers shared by rules. Rules never import each other; they share these."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.rule import Context

LOOPS = (cst.For, cst.While)
SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)
GRAD_SCALERS = ("GradScaler", "ShardedGradScaler")


def walk(node: cst.CSTNode, *, enter_scopes: bool = False) -> Iterator[cst.CSTNode]:
    """Descendants of ``node`` in source order (``node`` excluded); nested defs are skipped."""
    stack = list(reversed(node.children))
    while stack:
        n = stack.pop()
        yield n
        if not enter_scopes and isinstance(n, SCOPES):
            continue
        stack.extend(reversed(n.children))


def enclosing_loop(ctx: Context) -> cst.CSTNode | None:
    """The innermost for/while around the current node, within the current function."""
    for p in ctx.ancestors():
        if isinstance(p, LOOPS):
            return p
        if isinstance(p, SCOPES):
            return None
    return None


def enclosing_scope(ctx: Context) -> cst.CSTNode | None:
    """The innermost def/class/lambda around the current node (None at module level)."""
    for p in ctx.ancestors():
        if isinstance(p, SCOPES):
            return p
    return None


def method_call(node: cst.CSTNode, *methods: str) -> tuple[cst.BaseExpression, str] | None:
    """For ``recv.meth(...)`` with meth in ``methods``: (recv, meth)."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in methods:
        return node.func.value, node.func.attr.value
    return None


def is_grad_scaler_name(qualified: str | None) -> bool:
    return bool(qualified) and qualified.rsplit(".", 1)[-1] in GRAD_SCALERS  # type: ignore[union-attr]


def is_scaler(names: Names, expr: cst.BaseExpression) -> bool:
    """Whether ``expr`` (a receiver) holds a GradScaler: it was assigned from one in this
    file, or it is a plain name/attribute whose last part is called ``*scaler*``."""
    if is_grad_scaler_name(names.made_by(expr)):
        return True
    d = dotted_name(expr)
    return d is not None and "scaler" in d.rsplit(".", 1)[-1].lower()


def branch_path(ctx: Context) -> tuple[tuple[int, str], ...]:
    """For each enclosing if/try: (id of the node, which branch). Two paths that share an
    ``if`` but name different branches can never run in the same pass."""
    out = []
    stack = ctx.parents
    for i in range(len(stack) - 1):
        p, child = stack[i], stack[i + 1]
        if isinstance(p, cst.If):
            out.append((id(p), "body" if child is p.body else "orelse"))
        elif isinstance(p, cst.Try):
            out.append((id(p), "body" if child is p.body else f"handler{id(child)}"))
    return tuple(out)


def exclusive(a: tuple[tuple[int, str], ...], b: tuple[tuple[int, str], ...]) -> bool:
    da = dict(a)
    return any(k in da and da[k] != v for k, v in b)


def statement_of(ctx: Context) -> tuple[cst.SimpleStatementLine, cst.CSTNode] | None:
    """The simple statement line holding the current node and the block that holds it."""
    stack = ctx.parents
    for i in range(len(stack) - 1, 0, -1):
        if isinstance(stack[i], cst.SimpleStatementLine):
            parent = stack[i - 1]
            if isinstance(parent, (cst.IndentedBlock, cst.Module)):
                return stack[i], parent  # type: ignore[return-value]
            return None
        if isinstance(stack[i], (cst.Lambda, cst.BaseCompoundStatement)):
            return None
    return None


def names_in(node: cst.CSTNode) -> Iterator[str]:
    """Every identifier and attribute name in an expression, lower-cased."""
    if isinstance(node, cst.Name):
        yield node.value.lower()
    for n in walk(node, enter_scopes=True):
        if isinstance(n, cst.Name):
            yield n.value.lower()
