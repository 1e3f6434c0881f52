"""Small CST helpers shared by rules. Rules never import each other; they share these."""

from __future__ import annotations

import re

from typing import Iterator

import libcst as cst

from ampdoctor.lint import tree
from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.rule import Context

LOOPS = (cst.For, cst.While)
SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


def walk(node: cst.CSTNode, *, enter_scopes: bool = False) -> Iterator[cst.CSTNode]:
    """Descendants of ``node`` in source order (``node`` excluded); nested defs are skipped.

    Whitespace, punctuation and comment nodes are not visited (see ``tree.py``)."""
    return tree.walk(node, skip=() if enter_scopes else SCOPES)


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


def mark_enclosing_functions(ctx: Context, marked: set[int]) -> None:
    """Add the ids of the functions around the current node to ``marked``. A rule that reads
    whole functions in ``leave_FunctionDef`` marks the ones holding what it looks for during the
    walk, and skips the others."""
    for p in ctx.ancestors():
        if isinstance(p, cst.FunctionDef):
            if id(p) in marked:
                return  # so are the ones around it
            marked.add(id(p))


def in_try_finally(ctx: Context) -> cst.Try | None:
    """The innermost ``try`` (in the current function) whose body holds the current node and
    that has a ``finally:``."""
    stack = ctx.parents
    for i in range(len(stack) - 2, -1, -1):
        p, child = stack[i], stack[i + 1]
        if isinstance(p, SCOPES):
            return None
        if isinstance(p, cst.Try) and child is p.body and p.finalbody is not None:
            return p
    return None


def method_call(node: cst.CSTNode, *methods: str) -> tuple[cst.BaseExpression, str] | None:
    """For ``recv.meth(...)`` with meth in ``methods``: (recv, meth)."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in methods:
        return node.func.value, node.func.attr.value
    return None


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


def loop_header(loop: cst.CSTNode) -> list[cst.CSTNode]:
    """What a loop's header reads: a ``for``'s target and iterable, a ``while``'s test."""
    return [loop.target, loop.iter] if isinstance(loop, cst.For) else [loop.test]  # type: ignore[attr-defined]


# a quantity of one epoch, not a count of epochs: `iters_per_epoch`, `total_it_each_epoch`
_PER_EPOCH = re.compile(r"(per|each|every|in|one)_?epoch", re.I)


def epoch_loop(loop: cst.CSTNode) -> bool:
    """``for epoch in range(...)``, ``while epoch < n``, ``range(self.num_epochs)``: a loop over
    epochs. ``range(start_it, total_it_each_epoch)`` is a loop over the batches of one epoch."""
    return any("epoch" in n.lower() and not _PER_EPOCH.search(n)
               for part in loop_header(loop) for n in names_in(part))


# -- dtypes ------------------------------------------------------------------------------

_DTYPES = {
    "torch.float16": "float16", "torch.half": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32", "torch.float": "float32",
    "torch.float64": "float64", "torch.double": "float64",
}
_DTYPE_STRINGS = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16",
                  "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}


def string_value(node: cst.CSTNode | None) -> str | None:
    """The value of a plain string literal (no f-strings), else None."""
    if isinstance(node, cst.SimpleString):
        try:
            v = node.evaluated_value
        except Exception:
            return None
        return v if isinstance(v, str) else None
    return None


def dtype_of(names: Names, expr: cst.CSTNode | None) -> str | None:
    """``torch.float16``/``torch.half``/``"fp16"`` -> ``"float16"`` (also bfloat16, float32, float64)."""
    if expr is None:
        return None
    q = names.qualified(expr)
    if q in _DTYPES:
        return _DTYPES[q]
    s = string_value(expr)
    if s is not None:
        return _DTYPE_STRINGS.get(s.lower())
    return None


def mentions_dtype(names: Names, expr: cst.CSTNode, dtype: str) -> bool:
    """Whether ``dtype`` appears anywhere in ``expr`` (``torch.bfloat16 if x else torch.float16``)."""
    return dtype_of(names, expr) == dtype or any(dtype_of(names, n) == dtype for n in walk(expr, enter_scopes=True))


def number_value(node: cst.CSTNode | None) -> float | None:
    """The value of a numeric literal, with unary minus/plus, ``float("...")``, ``1e-9``; else None."""
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
        v = number_value(node.expression)
        if v is None:
            return None
        return -v if isinstance(node.operator, cst.Minus) else v
    if isinstance(node, (cst.Integer, cst.Float)):
        try:
            return float(node.evaluated_value)
        except (ValueError, OverflowError):
            return None
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value in ("float", "int") \
            and len(node.args) == 1:
        s = string_value(node.args[0].value)
        if s is not None:
            try:
                return float(s)
            except ValueError:
                return None
        return number_value(node.args[0].value)
    return None


# -- calls -------------------------------------------------------------------------------

def arg(call: cst.Call, position: int | None, keyword: str | None) -> cst.BaseExpression | None:
    """The value passed for a parameter, by keyword or by position (no *args/**kwargs)."""
    if keyword is not None:
        for a in call.args:
            if a.keyword is not None and a.keyword.value == keyword:
                return a.value
    if position is not None:
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if position < len(positional):
            return positional[position].value
    return None


def has_star_args(call: cst.Call) -> bool:
    return any(a.star for a in call.args)


# -- compatibility shims ------------------------------------------------------------------

_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError"}
_VERSION_WORDS = ("version", "hasattr", "torch_version", "is_torch", "parse", "packaging")


def in_compat_guard(ctx: Context) -> bool:
    """Inside a try/except-ImportError shim or a torch-version / hasattr check."""
    stack = ctx.parents
    for i in range(len(stack) - 2, -1, -1):
        p = stack[i]
        if isinstance(p, cst.Try):
            for hnd in p.handlers:
                t = hnd.type
                caught = []
                if t is None:  # a bare `except:` is a shim only around imports
                    caught = ["ImportError"] if any(isinstance(n, (cst.Import, cst.ImportFrom))
                                                    for n in walk(p.body)) else []
                elif isinstance(t, cst.Tuple):
                    caught = [dotted_name(e.value) or "" for e in t.elements]
                else:
                    caught = [dotted_name(t) or ""]
                if any(c.rsplit(".", 1)[-1] in _IMPORT_ERRORS for c in caught):
                    return True
        elif isinstance(p, (cst.If, cst.IfExp)):
            test = p.test
            words = " ".join(names_in(test))
            if any(w in words for w in _VERSION_WORDS if w != "hasattr"):
                return True
            if "hasattr" in words and any(_torch_hasattr(ctx.names, n) for n in [test, *walk(test, enter_scopes=True)]):
                return True
    return False


_AMP_ATTRS = ("amp", "autocast", "scaler", "custom_fwd", "custom_bwd", "is_bf16", "bf16", "float16", "bfloat16",
              "get_autocast")


def _torch_hasattr(names: Names, node: cst.CSTNode) -> bool:
    """``hasattr(torch.amp, "autocast")``, ``hasattr(torch, "autocast")``: a check for an API of
    torch, unlike ``hasattr(model, "to_channels_last")``."""
    if not (isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "hasattr"
            and len(node.args) >= 2):
        return False
    obj = names.qualified(node.args[0].value) or ""
    attr = (string_value(node.args[1].value) or "").lower()
    return obj == "torch" or obj.startswith("torch.") or any(w in attr for w in _AMP_ATTRS)
