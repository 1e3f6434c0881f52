"""Branches: which arm of which precision switch a node runs in."""

from __future__ import annotations

import re

import libcst as cst

from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import Names
from ampdoctor.lint.rule import Context
from ampdoctor.lint.semantic import vocabulary as voc

_BF16_STRINGS = {"bf16", "bfloat16", "bf16-mixed", "bf16-true", "bf16_mixed"}


def selects_bf16(names: Names, test: cst.CSTNode) -> bool:
    """A test that is true exactly for a bfloat16 run: ``args.bf16``, ``use_bf16``,
    ``dtype == torch.bfloat16``, ``precision == "bf16"``, ``args.precision in ("bf16", "bf16-mixed")``."""
    if isinstance(test, (cst.Name, cst.Attribute)):
        return voc.is_bf16_flag(test)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        op = test.comparisons[0].operator
        right = test.comparisons[0].comparator
        if isinstance(op, cst.Equal):
            sides = (test.left, right)
            return any(h.dtype_of(names, s) == "bfloat16" or (h.string_value(s) or "").lower() in _BF16_STRINGS
                       for s in sides)
        if isinstance(op, cst.In) and isinstance(right, (cst.Tuple, cst.List, cst.Set)):
            vals = [e.value for e in right.elements]
            return bool(vals) and all(h.dtype_of(names, v) == "bfloat16" or
                                      (h.string_value(v) or "").lower() in _BF16_STRINGS for v in vals)
    return False


def bf16_arm(ctx: Context) -> cst.CSTNode | None:
    """The test of the innermost ``if`` (in the current function) whose true arm holds the
    current node and which runs only for bfloat16, else None."""
    stack = ctx.parents
    for i in range(len(stack) - 2, -1, -1):
        p, child = stack[i], stack[i + 1]
        if isinstance(p, cst.If) and child is p.body:
            if selects_bf16(ctx.names, p.test):
                return p.test
            if voc.PRECISION_WORDS.intersection(w for n in h.names_in(p.test) for w in voc.words(n)):
                return None  # another precision switch is nearer
        if isinstance(p, h.SCOPES):
            return None
    return None


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
