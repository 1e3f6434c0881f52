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
    scope_node: cst.CSTNode | None = None


def _is_setter_fp16(names, call: cst.Call, q: str) -> bool:
    if not call.args:
        return False
    a = call.args[0].value
    if q == "torch.set_default_dtype":
        return h.dtype_of(names, a) == "float16"
    return names.qualified(a) in _HALF_TYPES or h.string_value(a) in _HALF_TYPES


def _teardown(names, fn: cst.FunctionDef) -> bool:
    """A pytest fixture (a generator or ``@pytest.fixture``) or a unittest/pytest teardown."""
    name = fn.name.value
    if name.lower().startswith(("teardown", "tear_down")) or name in ("tearDown", "tearDownClass"):
        return True
    if any("fixture" in (names.qualified(d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator) or "")
           for d in fn.decorators):
        return True
    return any(isinstance(n, (cst.Yield,)) for n in h.walk(fn.body))


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
        self.teardown_restores = False  # a fixture or teardown sets the default back after each test
        self.trains = False  # the file runs backward or steps an optimizer
        self.in_test: set[int] = set()  # ids of sets made inside a test function

    def visit_Call(self, node: cst.Call) -> None:
        q = self.ctx.names.qualified(node.func)
        if q not in _SETTERS:
            if h.method_call(node, "backward", "step"):
                self.trains = True
            return
        fp16 = _is_setter_fp16(self.ctx.names, node, q)
        if fp16 and self._restored_by_finally():
            return
        scope = next((p for p in self.ctx.ancestors() if isinstance(p, h.SCOPES)), None)
        if not fp16 and isinstance(scope, cst.FunctionDef) and _teardown(self.ctx.names, scope):
            self.teardown_restores = True
        if isinstance(scope, cst.FunctionDef) and scope.name.value.startswith("test"):
            self.in_test.add(id(node))
        self.sets.append(_Set(node, fp16, id(scope), len(self.sets), h.branch_path(self.ctx),
                              scope if scope is not None else self.ctx.parents[0]))

    def _entry_point(self) -> bool:
        """The file is a program (`if __name__ == "__main__":`), not a module others import and train with."""
        module = self.ctx.parents[0] if self.ctx.parents else None
        for stmt in getattr(module, "body", ()):
            if isinstance(stmt, cst.If) and "__main__" in cst.Module([]).code_for_node(stmt.test):
                return True
        return False

    def _after_model_cast(self, s: _Set) -> bool:
        """A model was made float16 (strong evidence: `model.half()`, `model.to(torch.float16)`)
        earlier in the same function, on a path that reaches this call (THUMT's `--half`)."""
        from ampdoctor.lint.semantic.evidence import STRONG
        from ampdoctor.lint.semantic.facts import facts_of
        from ampdoctor.lint.semantic.flow import flow_of

        if not isinstance(s.scope_node, (cst.FunctionDef, cst.Module)):
            return False
        flow = flow_of(self.ctx, s.scope_node)
        at = flow.pos(s.node)
        for f in facts_of(self.ctx).evidence.facts:
            if f.kind != "cast" or f.strength != STRONG:
                continue
            if -1 < flow.pos(f.node) < at and not h.exclusive(flow.branches(f.node), flow.branches(s.node)):
                return True
        return False

    def _restored_by_finally(self) -> bool:
        t = h.in_try_finally(self.ctx)
        return t is not None and any(isinstance(n, cst.Call) and self.ctx.names.qualified(n.func) in _SETTERS
                                     for n in h.walk(t.finalbody))

    def leave_Module(self, node: cst.Module) -> None:
        if self.teardown_restores:
            return  # tests that set float16 are undone by the file's fixture/teardown
        for s in self.sets:
            if not s.fp16:
                continue
            if not self.trains and (id(s.node) in self.in_test or self._entry_point()):
                continue  # a test or a script that only runs a model in float16 (THUMT's scorer): nothing trains
            # a later call in the same function that sets another dtype restores it (scoped use)
            if any(o.scope == s.scope and o.order > s.order and not o.fp16 and not h.exclusive(o.branches, s.branches)
                   for o in self.sets):
                continue
            if self._after_model_cast(s):
                continue  # `model = model.half()` then the default: pure float16 on purpose, new tensors match it
            call = cst.Module([]).code_for_node(s.node)
            self.report(s.node, self.message.format(call=call if len(call) < 60 else "set_default_dtype(float16)"))
