"""Branches: which arm of which precision switch a node runs in."""

from __future__ import annotations

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
