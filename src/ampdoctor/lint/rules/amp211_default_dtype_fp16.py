from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.rule import Rule

_SETTERS = {"torch.set_default_dtype", "torch.set_default_tensor_type"}
_HALF_TYPES = {"torch.HalfTensor", "torch.cuda.HalfTensor"}


@dataclass
class _Set:
    node: cst.Call
    fp16: bool
    scope: int
    order: int
    branches: tuple


def _is_setter_fp16(names, call: cst.Call, q: str) -> bool:
    if not call.args:
        return False
    a = call.args[0].value
    if q == "torch.set_default_dtype":
        return h.dtype_of(names, a) == "float16"
    return names.qualified(a) in _HALF_TYPES or h.string_value(a) in _HALF_TYPES


class DefaultDtypeFp16(Rule):
    """``torch.set_default_dtype(torch.float16)`` left in effect."""

    code = "AMP211"
    name = "default-dtype-fp16"
    severity = Severity.WARNING
    message = ("`{call}` makes every float tensor and parameter created afterwards float16: a model built "
               "after it trains without float32 master weights, and constants such as 1e-8 become 0. Pass "
               "`dtype=`/`torch_dtype=` where float16 is wanted, or train in float32 with autocast.")
    words = (b"set_default_dtype", b"set_default_tensor_type")
    summary = "`torch.set_default_dtype(torch.float16)` that is never restored."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.sets: list[_Set] = []

    def visit_Call(self, node: cst.Call) -> None:
        q = self.ctx.names.qualified(node.func)
        if q not in _SETTERS:
            return
        fp16 = _is_setter_fp16(self.ctx.names, node, q)
        if fp16 and self._restored_by_finally():
            return
        scope = next((p for p in self.ctx.ancestors() if isinstance(p, h.SCOPES)), None)
        self.sets.append(_Set(node, fp16, id(scope), len(self.sets), h.branch_path(self.ctx)))

    def _restored_by_finally(self) -> bool:
        stack = self.ctx.parents
        for i in range(len(stack) - 2, -1, -1):
            p, child = stack[i], stack[i + 1]
            if isinstance(p, h.SCOPES):
                return False
            if isinstance(p, cst.Try) and child is p.body and p.finalbody is not None:
                for n in h.walk(p.finalbody):
                    if isinstance(n, cst.Call) and self.ctx.names.qualified(n.func) in _SETTERS:
                        return True
        return False

    def leave_Module(self, node: cst.Module) -> None:
        for s in self.sets:
            if not s.fp16:
                continue
            # a later call in the same function that sets another dtype restores it (scoped use)
            if any(o.scope == s.scope and o.order > s.order and not o.fp16 and not h.exclusive(o.branches, s.branches)
                   for o in self.sets):
                continue
            call = cst.Module([]).code_for_node(s.node)
            self.report(s.node, self.message.format(call=call if len(call) < 60 else "set_default_dtype(float16)"))
