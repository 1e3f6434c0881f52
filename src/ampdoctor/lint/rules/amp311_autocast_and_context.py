from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.rule import FixSpec, Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic import source


def _called(expr: cst.BaseExpression) -> str:
    """`torch.set_grad_enabled(...)` for a call, the short text of anything else."""
    if isinstance(expr, cst.Call):
        return source.short(expr.func, 30) + "(...)"
    return source.short(expr, 30)


class AutocastAndContext(Rule):
    """``with autocast(...) and other(...):`` enters only one of the two context managers."""

    code = "AMP311"
    name = "autocast-and-context"
    severity = Severity.ERROR
    in_tests = True  # a bug whatever the test intends
    message = ("`with {expr}` enters only `{entered}`: `{op}` returns one of its operands, so {lost} never "
               "runs. Separate the context managers with a comma: `with {a}, {b}:`.")
    fix_title = "Enter both context managers: `with a, b:`"
    fix_availability = "unsafe"
    words = (b"autocast",)
    summary = "`with autocast(...) and other(...):` enters only one of the two, so autocast may never run."

    def visit_With(self, node: cst.With) -> None:
        names = self.ctx.names
        items = list(node.items)
        for i, item in enumerate(items):
            expr = item.item
            if not (isinstance(expr, cst.BooleanOperation) and isinstance(expr.operator, (cst.And, cst.Or))):
                continue
            left, right = expr.left, expr.right
            sides = [acs.autocast_call(names, s) is not None for s in (left, right)]
            if not any(sides):
                continue
            # `a and b` is `b` when `a` is truthy (a context manager object is), `a or b` is `a`
            entered, lost = (right, left) if isinstance(expr.operator, cst.And) else (left, right)
            lost_text = ("autocast" if acs.autocast_call(names, lost) is not None
                         else f"`{source.short(lost, 40)}`")
            op = "and" if isinstance(expr.operator, cst.And) else "or"
            msg = self.message.format(expr=f"{_called(left)} {op} {_called(right)}", entered=_called(entered),
                                      op=op, lost=lost_text, a=source.short(left, 40), b=source.short(right, 40))
            fix = None
            if item.asname is None:
                new_items = [*items[:i], cst.WithItem(left, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                             cst.WithItem(right, comma=item.comma), *items[i + 1:]]
                fix = FixSpec(((node, node.with_changes(items=new_items)),), safe=False, title=self.fix_title)
            self.report(expr, msg, fix)
