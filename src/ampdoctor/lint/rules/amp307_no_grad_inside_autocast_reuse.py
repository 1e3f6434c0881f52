from __future__ import annotations

import builtins
from dataclasses import dataclass

import libcst as cst
from ampdoctor.lint import tree as _tree

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic import source
from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic.backward import is_backward_call

_NO_GRAD = {"torch.no_grad", "torch.autograd.no_grad", "torch.autograd.grad_mode.no_grad"}
_SET_GRAD = {"torch.set_grad_enabled", "torch.autograd.set_grad_enabled",
             "torch.autograd.grad_mode.set_grad_enabled"}
_INFERENCE = {"torch.inference_mode", "torch.autograd.inference_mode", "torch.autograd.grad_mode.inference_mode"}
_BUILTINS = set(dir(builtins))
# the torch release that fixed the no_grad/autocast-cache interaction (pytorch PR#165068)
_FIXED_IN = (2, 11)


@dataclass
class _Candidate:
    region: acs.Region
    no_grad: cst.With
    keys: dict[str, str]  # module key -> how it was called
    scope: cst.CSTNode  # the function (or module) holding both


class NoGradInsideAutocastReuse(Rule):
    """A module run under ``no_grad()`` inside an autocast region, then again with grad in that region."""

    code = "AMP307"
    name = "no-grad-inside-autocast-reuse"
    severity = Severity.ERROR
    message = ("`{m}` runs under `no_grad()`, then with gradients, in one autocast region: the autocast weight cache gives the second pass the low-precision weights cast "
               "without autograd history, so those weights get no gradient (pytorch#105211, fixed in torch "
               "2.11). Leave the autocast region before the `no_grad()` block, or pass "
               "`cache_enabled=False` to autocast.")
    fix_availability = None
    words = (b"no_grad", b"set_grad_enabled")
    also = (b"autocast",)
    summary = "Forward under `no_grad()` then forward+backward through the same module in one autocast region."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.candidates: list[_Candidate] = []

    def _grad_off(self, w: cst.With) -> bool:
        for item in w.items:
            c = item.item
            if not isinstance(c, cst.Call):
                continue
            q = self.ctx.names.qualified(c.func)
            if q in _NO_GRAD or q in _INFERENCE:
                return True
            if q in _SET_GRAD:
                v = h.arg(c, 0, "mode")
                if isinstance(v, cst.Name) and v.value == "False":
                    return True
            ac = acs.autocast_call(self.ctx.names, c)
            if ac is not None and ac.enabled is False:
                return True
        return False

    def _is_no_grad(self, w: cst.With) -> bool:
        for item in w.items:
            c = item.item
            if isinstance(c, cst.Call):
                q = self.ctx.names.qualified(c.func)
                if q in _NO_GRAD:
                    return True
                if q in _SET_GRAD:
                    v = h.arg(c, 0, "mode")
                    if isinstance(v, cst.Name) and v.value == "False":
                        return True
        return False

    def _module_key(self, call: cst.Call) -> str | None:
        func = call.func
        d = dotted_name(func)
        if d is None:
            return None
        if d.endswith(".forward"):
            d = d[: -len(".forward")]
            func = func.value  # type: ignore[attr-defined]
        if isinstance(func, cst.Name):
            if func.value in _BUILTINS or func.value in self.ctx.names.aliases:
                return None
            return d
        if d.startswith("self.") and d.count(".") <= 2:
            return d
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "forward":
            return d
        return None

    def visit_With(self, node: cst.With) -> None:
        if self.ctx.min_torch is not None and self.ctx.min_torch >= _FIXED_IN:
            return
        if not self._is_no_grad(node):
            return
        region = acs.active_region(self.ctx)
        if region is None or not isinstance(region.node, cst.With) or acs.cache_enabled(region.ac) is False:
            return
        keys: dict[str, str] = {}
        for c in source.module_calls(node.body):
            k = self._module_key(c)
            if k is not None:
                keys.setdefault(k, source.short(c.func))
        if not keys:
            return
        scope = next((p for p in self.ctx.ancestors() if isinstance(p, (cst.FunctionDef, cst.Module))), None)
        if scope is None:
            return
        self.candidates.append(_Candidate(region, node, keys, scope))

    def leave_Module(self, node: cst.Module) -> None:
        orders: dict[int, dict] = {}
        for cand in self.candidates:
            if id(cand.scope) not in orders:
                orders[id(cand.scope)] = source.order(cand.scope)
            pos = orders[id(cand.scope)]
            after = pos[id(cand.no_grad)][1]
            forward = self._later_forward(cand, pos, after)
            if forward is None:
                continue
            call, key = forward
            start = pos[id(call)][1]
            if not any(pos[id(n)][0] > start for n in self._backwards(cand.scope)):
                continue
            self.report(call, self.message.format(m=cand.keys[key]))

    def _later_forward(self, cand: _Candidate, pos, after: int):
        found = None

        def visit(n: cst.CSTNode) -> bool:
            nonlocal found
            if isinstance(n, h.SCOPES):
                return False
            if isinstance(n, cst.With) and self._grad_off(n):
                return False
            if isinstance(n, cst.Call):
                q = self.ctx.names.qualified(n.func)
                if q == "torch.clear_autocast_cache" and pos[id(n)][0] > after:
                    return True  # the cache is dropped: nothing later is affected
                if pos[id(n)][0] > after:
                    k = self._module_key(n)
                    if k in cand.keys:
                        found = (n, k)
                        return True
            for c in _tree.children(n):
                if visit(c):
                    return True
            return False

        visit(cand.region.body)
        return found

    def _backwards(self, scope: cst.CSTNode):
        for n in h.walk(scope):
            if isinstance(n, cst.Call):
                if is_backward_call(self.ctx.names, n):
                    yield n
