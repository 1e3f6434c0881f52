from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import vocabulary as voc

_GRAD = {"torch.autograd.grad", "torch.autograd.functional.vjp"}


class GradPenaltyUnscaled(Rule):
    """``torch.autograd.grad(out, x, create_graph=True)`` on unscaled outputs while a GradScaler runs."""

    code = "AMP111"
    name = "grad-penalty-unscaled"
    severity = Severity.WARNING
    message = ("`torch.autograd.grad(..., create_graph=True)` differentiates the unscaled `{out}` while `{s}` "
               "scales the loss: these float16 gradients get no loss scaling, so small ones underflow to 0 and "
               "the penalty built on them is wrong. Pass `{s}.scale({out})` as the outputs and divide the "
               "gradients by `{s}.get_scale()` (the torch AMP gradient-penalty recipe).")
    fix_availability = "suggestion"
    words = (b"create_graph",)
    also = (b"scaler", b"Scaler")
    summary = "A gradient penalty (`autograd.grad(create_graph=True)`) on unscaled outputs while a GradScaler is used."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        # id(function) -> candidate grad calls, with the if/else arms around each
        self.calls: dict[int, list[tuple[cst.Call, tuple]]] = {}
        # id(function) -> the scalers it scales a loss with, and the arms around each scale()
        self.scalers: dict[int, list[tuple[str, tuple]]] = {}

    def _function(self) -> cst.FunctionDef | None:
        return next((p for p in self.ctx.ancestors() if isinstance(p, cst.FunctionDef)), None)

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        scaler = voc.scaled_by(names, node)
        if scaler is not None:
            fn = self._function()
            if fn is not None:
                self.scalers.setdefault(id(fn), []).append((scaler, h.branch_path(self.ctx)))
            return
        if names.qualified(node.func) not in _GRAD:
            return
        cg = h.arg(node, None, "create_graph")
        if not (isinstance(cg, cst.Name) and cg.value == "True"):
            return
        fn = self._function()
        if fn is not None:
            self.calls.setdefault(id(fn), []).append((node, h.branch_path(self.ctx)))

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        calls = self.calls.pop(id(node), None)
        scales = self.scalers.get(id(node))
        if not calls or not scales:
            return
        scaled_names = self._scaled_names(node)
        for call, arms in calls:
            # the scaler must be in use where the penalty runs: not only in the other arm of
            # `if scaler: ... else: autograd.grad(...)`
            live = [s for s, s_arms in scales if not h.exclusive(arms, s_arms)]
            if not live:
                continue
            scaler = live[0]
            out = h.arg(call, 0, "outputs")
            if out is None or self._scaled(out, scaled_names):
                continue
            text = " ".join(cst.Module([]).code_for_node(out).split())
            self.report(call, self.message.format(out=text if len(text) <= 30 else "outputs", s=scaler))

    def _scaled(self, expr: cst.BaseExpression, scaled_names: set[str]) -> bool:
        for n in [expr, *h.walk(expr)]:
            if voc.scaled_by(self.ctx.names, n) is not None:
                return True
            if isinstance(n, cst.Name) and n.value in scaled_names:
                return True
        return False

    def _scaled_names(self, fn: cst.FunctionDef) -> set[str]:
        """Names bound to ``scaler.scale(...)`` results in the function."""
        out: set[str] = set()
        for n in h.walk(fn.body):
            if isinstance(n, cst.Assign) and self._scaled(n.value, set()):
                for t in n.targets:
                    if isinstance(t.target, cst.Name):
                        out.add(t.target.value)
        return out
