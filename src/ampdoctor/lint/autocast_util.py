"""Helpers shared by the autocast-usage rules (AMP303-AMP309) and the deprecated-API
rules (AMP501, AMP502). Only those rules import this module."""

from __future__ import annotations

import re
from typing import Iterator

import libcst as cst
from ampdoctor.lint import tree as _tree

from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import Names
from ampdoctor.lint.rule import Context
from ampdoctor.lint.semantic import vocabulary as voc

# torch.autocast(device_type, dtype, enabled, cache_enabled) and the device-specific
# torch.cuda.amp.autocast(enabled, dtype, cache_enabled): where cache_enabled sits
_CACHE_POS_GENERIC = 3
_CACHE_POS_DEVICE = 2


def code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def short(node: cst.CSTNode, limit: int = 40) -> str:
    """Source of a node on one line, shortened for messages."""
    s = " ".join(code(node).split())
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


def module_calls(node: cst.CSTNode) -> Iterator[cst.Call]:
    for n in h.walk(node):
        if isinstance(n, cst.Call):
            yield n


def in_fallback(ctx: Context, uses_new_api) -> bool:
    """Inside an ``except`` handler (of any exception type) of a ``try`` whose body uses the new
    API, e.g. ``try: torch.is_autocast_enabled(dev) except TypeError: torch.is_autocast_cpu_enabled()``.
    ``uses_new_api(qualified_name)`` says whether a name in the ``try`` body is the new API."""
    stack = ctx.parents
    for i in range(len(stack) - 2, 0, -1):
        p = stack[i]
        if isinstance(p, cst.ExceptHandler) and isinstance(stack[i - 1], cst.Try):
            for n in h.walk(stack[i - 1].body, enter_scopes=True):
                if isinstance(n, (cst.Attribute, cst.Name)) and uses_new_api(ctx.names.qualified(n) or ""):
                    return True
        if isinstance(p, h.SCOPES):
            return False
    return False


def mentions_precision(node: cst.CSTNode, extra: frozenset[str] = frozenset()) -> bool:
    """Whether an identifier in ``node`` names a precision setting (``use_bf16``, ``amp_dtype``...)."""
    for n in [node, *h.walk(node, enter_scopes=True)]:
        if isinstance(n, cst.Name) and (voc.PRECISION_WORDS | extra).intersection(voc.words(n.value)):
            return True
    return False


def under_precision_branch(ctx: Context, root: cst.CSTNode) -> bool:
    """Inside an if/else (or ``a if c else b``) below ``root`` whose condition is about precision."""
    stack = ctx.parents
    for i in range(len(stack) - 2, -1, -1):
        p, child = stack[i], stack[i + 1]
        if p is root:
            return False
        if isinstance(p, (cst.If, cst.IfExp)) and child is not p.test and \
                mentions_precision(p.test, frozenset({"pure", "fp8", "int8", "quant", "quantized"})):
            return True
    return False


_VERSION_FLAG = re.compile(r"(?:^|_)(?:torch|pytorch|pt|th)_?(?:\d|version|greater|less|ge_|gt_|le_|lt_|geq|leq|"
                           r"newer|older|at_least)|version|^is_torch")


def in_version_guard(ctx: Context) -> bool:
    """Under ``helpers.in_compat_guard`` or a branch on a torch-version flag that it does not
    recognise: ``X if _TORCH_GREATER_EQUAL_2_4 else Y``, ``if TORCH_GE_2_4:``, ``if is_torch_2:``."""
    if h.in_compat_guard(ctx):
        return True
    stack = ctx.parents
    for i in range(len(stack) - 2, -1, -1):
        p, child = stack[i], stack[i + 1]
        if isinstance(p, (cst.If, cst.IfExp, cst.While)) and child is not p.test:
            for n in [p.test, *h.walk(p.test, enter_scopes=True)]:
                if isinstance(n, cst.Name) and _VERSION_FLAG.search(n.value.lower()):
                    return True
    return False
