"""Casts: what dtype a conversion call converts to, and whether an expression up- or downcasts."""

from __future__ import annotations

from typing import Iterator

import libcst as cst

from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import Names, dotted_name

_CAST_METHODS = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16"}
UPCAST = ("float32", "float64")


def cast_target(names: Names, call: cst.CSTNode) -> str | None:
    """The dtype a conversion call ``r.float()``, ``r.half()``, ``r.to(..dtype..)``,
    ``r.type(dtype)`` converts to; "?" for ``.to``/``.type``/``.type_as`` with a dtype that is
    not a literal (``.to(x.dtype)``); None when the call is not a dtype conversion."""
    mc = h.method_call(call, *_CAST_METHODS, "to", "type", "type_as")
    if mc is None:
        return None
    _, meth = mc
    assert isinstance(call, cst.Call)
    if meth in _CAST_METHODS:
        return _CAST_METHODS[meth] if not call.args else None
    if meth == "type_as":
        return "?"
    if meth == "type":
        if not call.args:
            return None  # `x.type()` returns the type string
        return h.dtype_of(names, call.args[0].value) or "?"
    # .to(dtype) / .to(device, dtype) / .to(dtype=...) / .to(other) / .to(device)
    kw = h.arg(call, None, "dtype")
    if kw is not None:
        return h.dtype_of(names, kw) or "?"
    for a in call.args:
        if a.keyword is None and not a.star:
            d = h.dtype_of(names, a.value)
            if d is not None and not isinstance(a.value, cst.SimpleString):
                return d
    for a in call.args:
        if a.keyword is None and not a.star and _looks_like_dtype_expr(a.value):
            return "?"
    return None


def _looks_like_dtype_expr(node: cst.BaseExpression) -> bool:
    d = dotted_name(node)
    return d is not None and "dtype" in d.rsplit(".", 1)[-1].lower()


def dtype_kwarg(names: Names, call: cst.Call) -> str | None:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == "dtype":
            return h.dtype_of(names, a.value) or "?"
    return None


def has_upcast(names: Names, expr: cst.CSTNode) -> bool:
    """Whether ``expr`` explicitly computes in float32/float64 somewhere: ``.float()``,
    ``.double()``, ``.to(torch.float32)``, ``.type(torch.float32)``, ``dtype=torch.float32``."""
    for n in _self_and_walk(expr):
        if isinstance(n, cst.Call):
            if cast_target(names, n) in UPCAST:
                return True
            if dtype_kwarg(names, n) in UPCAST:
                return True
    return False


def has_downcast(names: Names, expr: cst.CSTNode) -> bool:
    """A conversion to a non-float32 or unknown dtype (``.half()``, ``.to(x.dtype)``)."""
    for n in _self_and_walk(expr):
        if isinstance(n, cst.Call):
            t = cast_target(names, n)
            if t is not None and t not in UPCAST:
                return True
    return False


def _self_and_walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    yield node
    yield from h.walk(node, enter_scopes=False)


def possible_dtypes(names: Names, expr: cst.CSTNode | None) -> set[str]:
    """The dtypes a configuration value can take, as far as literals tell: ``"bfloat16"``,
    ``torch.bfloat16 if x else torch.float16``, ``{"bf16": torch.bfloat16, ...}["bf16"]``.
    A mapping subscripted by a variable tells nothing (its keys are choices, not a choice)."""
    if expr is None:
        return set()
    d = h.dtype_of(names, expr)
    if d is not None:
        return {d}
    if isinstance(expr, cst.IfExp):
        return possible_dtypes(names, expr.body) | possible_dtypes(names, expr.orelse)
    if isinstance(expr, cst.BooleanOperation):  # `args.dtype or "bfloat16"`
        return possible_dtypes(names, expr.left) | possible_dtypes(names, expr.right)
    if isinstance(expr, cst.Subscript) and isinstance(expr.value, cst.Dict) and len(expr.slice) == 1:
        sl = expr.slice[0].slice
        key = h.string_value(sl.value) if isinstance(sl, cst.Index) else None
        if key is None:
            return set()
        for el in expr.value.elements:
            if isinstance(el, cst.DictElement) and h.string_value(el.key) == key:
                return possible_dtypes(names, el.value)
        return set()
    return set()


def selectable_dtypes(names: Names, expr: cst.CSTNode | None, facts, depth: int = 0) -> set[str]:
    """Every dtype a setting can select, following the file's assignments: the arms of
    ``torch.float16 if p == "fp16" else torch.bfloat16``, each value of a dtype table looked up by
    a variable (``AMP_DTYPE[cfg.amp_dtype]`` with ``AMP_DTYPE = dict(float16=..., bfloat16=...)``),
    ``self.precision`` through what the file assigns to it. Unlike ``possible_dtypes`` (what one
    configuration holds), this is the set of choices."""
    if expr is None or depth > 3:
        return set()
    d = h.dtype_of(names, expr)
    if d is not None:
        return {d}
    if isinstance(expr, cst.IfExp):
        return selectable_dtypes(names, expr.body, facts, depth) | selectable_dtypes(names, expr.orelse, facts, depth)
    if isinstance(expr, cst.BooleanOperation):
        return selectable_dtypes(names, expr.left, facts, depth) | selectable_dtypes(names, expr.right, facts, depth)
    if isinstance(expr, cst.Subscript) and len(expr.slice) == 1:
        if isinstance(expr.value, cst.Dict) and possible_dtypes(names, expr):
            return possible_dtypes(names, expr)  # a literal key picks one entry
        out: set[str] = set()
        for table in _tables(expr.value, facts):
            for v in _table_values(table):
                out |= selectable_dtypes(names, v, facts, depth + 1)
        return out
    if isinstance(expr, (cst.Name, cst.Attribute)):
        target = dotted_name(expr)
        out = set()
        for v in (facts.assigned_values(target) if target else ()):
            out |= selectable_dtypes(names, v, facts, depth + 1)
        return out
    return set()


def _tables(expr: cst.BaseExpression, facts) -> list[cst.BaseExpression]:
    """A dict literal, or what the file binds the name of one to."""
    if isinstance(expr, (cst.Dict, cst.Call)):
        return [expr]
    target = dotted_name(expr)
    return list(facts.assigned_values(target)) if target else []


def _table_values(table: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(table, cst.Dict):
        return [el.value for el in table.elements if isinstance(el, cst.DictElement)]
    if isinstance(table, cst.Call) and isinstance(table.func, cst.Name) and table.func.value == "dict":
        return [a.value for a in table.args if a.keyword is not None]
    return []
