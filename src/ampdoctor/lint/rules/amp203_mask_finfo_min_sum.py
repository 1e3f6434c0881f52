from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import values as mu
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.semantic.flow import FunctionFlow, flow_of
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic.facts import facts_of

# results that cannot carry finfo.min on: booleans, bounded values, sizes
_STOP_METHODS = {"eq", "ne", "lt", "le", "gt", "ge", "bool", "isinf", "isneginf", "isposinf", "isnan", "isfinite",
                 "all", "any", "clamp", "clamp_", "clamp_min", "clamp_min_", "clip", "clip_", "maximum", "fmax",
                 "size", "dim", "numel", "argmax", "argmin", "logical_not", "logical_and", "logical_or", "long",
                 "int", "nonzero", "count_nonzero", "exp", "sigmoid", "softmax", "log_softmax"}
_VALUE_METHODS = {"masked_fill", "masked_fill_", "fill_", "new_full", "where", "index_fill", "index_fill_",
                  "masked_scatter", "masked_scatter_", "full_like"}
_CLAMPS = {"clamp", "clamp_", "clamp_min", "clamp_min_", "clip", "clip_", "maximum", "fmax", "max"}
_META = {"shape", "dtype", "device", "ndim"}


class MaskFinfoMinSum(Rule):
    """Adding two additive masks that each hold ``torch.finfo(dtype).min``."""

    code = "AMP203"
    name = "mask-finfo-min-sum"
    severity = Severity.WARNING
    message = ("Both sides of this `+` can hold `torch.finfo(...).min`: where both masks apply the sum "
               "overflows to -inf, which can turn a fully masked row into NaN after the softmax. Combine the "
               "boolean masks first and fill once, or clamp the sum with `.clamp(min=torch.finfo(dtype).min)`.")
    fix_availability = "suggestion"
    words = (b"finfo",)
    summary = "Two additive masks built from `torch.finfo(dtype).min` added together: the sum overflows to -inf (opt-in)."
    # off by default: the NaN needs a fully masked row whose scores also overflow float16, which a
    # file rarely shows; on held-out training code 1 finding in 6 was accepted
    default = False

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._returns: dict[int, bool] = {}  # id(FunctionDef) -> whether it can return finfo.min
        self._pending: list[cst.CSTNode] = []  # sums to report unless the file clamps its scores

    def leave_Module(self, node: cst.Module) -> None:
        if not self._pending:
            return
        clamped, applied = self._attention_facts(node)
        if not clamped and applied:
            for n in self._pending:
                self.report(n)

    def _attention_facts(self, module: cst.Module) -> tuple[bool, bool]:
        """(clamped, applied), from one walk over the file's functions.

        clamped: some function clamps to `finfo.min` and then takes a softmax, the attention
        itself (`torch.max(scores, torch.tensor(torch.finfo(dtype).min))`, the Hugging Face fix):
        a -inf mask sum is clamped before the softmax, so no row turns into NaN.

        applied: the file's attention adds a mask to its scores before a softmax (`scores + mask`),
        or passes one to a fused kernel (`attn_mask=...`). A file whose attention ignores it
        (`scaled_dot_product_attention(q, k, v, is_causal=True)`: "padding mask is ignored")
        never turns the -inf sum into NaN. A file with no attention at all builds masks for
        attention elsewhere (a model wrapper, a mask utility): that attention may add them."""
        names = self.ctx.names
        clamped = applied = attention_here = False
        for fn in h.walk(module, enter_scopes=True):
            if not isinstance(fn, cst.FunctionDef):
                continue
            softmax = added = clamp = False
            for n in h.walk(fn.body):
                if isinstance(n, cst.Call):
                    if mu.softmax_input(names, n) is not None:
                        softmax = attention_here = True
                        continue
                    q = names.qualified(n.func) or ""
                    last = q.rsplit(".", 1)[-1] or (n.func.attr.value if isinstance(n.func, cst.Attribute) else "")
                    if "scaled_dot_product" in last or "flash_attn" in last or "memory_efficient_attention" in last:
                        attention_here = True
                    if ("attention" in last or "attn" in last) and any(
                            a.keyword is not None and a.keyword.value in ("attn_mask", "attn_bias", "mask", "bias")
                            and not (isinstance(a.value, cst.Name) and a.value.value == "None") for a in n.args):
                        applied = True  # a fused kernel given a mask
                    elif last in _CLAMPS and any(mu.is_finfo_min(names, m) for a in n.args
                                                 for m in [a.value, *h.walk(a.value)]):
                        clamp = True
                elif isinstance(n, (cst.BinaryOperation, cst.AugAssign)) and isinstance(
                        n.operator, (cst.Add, cst.AddAssign)):
                    sides = (n.left, n.right) if isinstance(n, cst.BinaryOperation) else (n.target, n.value)
                    if all(any(True for _ in h.names_in(side)) for side in sides):
                        added = True  # `scores + mask`, `attn += bias` (not `x + 1`)
            clamped = clamped or (clamp and softmax)
            applied = applied or (added and softmax)
        # no attention in this file: the masks are built for attention elsewhere, which may add them
        return clamped, applied or not attention_here

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        names = self.ctx.names
        calls = facts_of(self.ctx).calls
        if not any(mu.is_finfo_min(names, n) or (isinstance(n, cst.Call) and calls.callee(n) is not None)
                   for n in h.walk(node.body)):
            return
        flow, binding_holds = self._holder(node)
        for n in flow.nodes:
            if isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.Add):
                left, right = n.left, n.right
            elif isinstance(n, cst.AugAssign) and isinstance(n.operator, cst.AddAssign):
                left, right = n.target, n.value
            else:
                continue
            at = flow.pos(n)
            if self._holds(left, flow, at, binding_holds) and self._holds(right, flow, at, binding_holds) \
                    and not self._clamped(n, flow):
                self._pending.append(n)

    def _holder(self, node: cst.FunctionDef):
        """The flow of ``node`` and ``binding_holds(name, at)``: whether the binding of a name
        visible at a position can hold finfo.min (memoised per binding)."""
        flow = flow_of(self.ctx, node)
        holds: dict[int, bool] = {}  # id(binding) -> whether its value can hold finfo.min

        def binding_holds(name: str, at: int) -> bool:
            b = flow.binding_at(name, at)
            if b is None:
                return False
            key = id(b)
            if key not in holds:
                holds[key] = False  # cycles (loops) end here
                value = b.value is not None and self._holds(b.value, flow, b.start, binding_holds)
                if b.aug:
                    value = value or binding_holds(b.name, b.start)
                holds[key] = value
            return holds[key]

        return flow, binding_holds

    def _returns_min(self, fn: cst.FunctionDef) -> bool:
        """An in-file helper that can return finfo.min (``causal_mask(n, dtype)``)."""
        key = id(fn)
        if key not in self._returns:
            self._returns[key] = False  # recursion ends here
            flow, binding_holds = self._holder(fn)
            self._returns[key] = any(isinstance(n, cst.Return) and n.value is not None and
                                     self._holds(n.value, flow, flow.pos(n), binding_holds) for n in flow.nodes)
        return self._returns[key]

    def _holds(self, expr: cst.CSTNode, flow: FunctionFlow, at: int, binding_holds) -> bool:
        names = self.ctx.names
        if mu.is_finfo_min(names, expr):
            return True
        if isinstance(expr, (cst.Comparison, cst.BooleanOperation)):
            return False
        if isinstance(expr, cst.UnaryOperation):
            if isinstance(expr.operator, (cst.Not, cst.BitInvert, cst.Minus)):
                return False  # booleans, and -min is +max
            return self._holds(expr.expression, flow, at, binding_holds)
        if isinstance(expr, (cst.Name, cst.Attribute)):
            if isinstance(expr, cst.Attribute) and expr.attr.value in _META:
                return False
            d = dotted_name(expr)
            if d is not None:
                return binding_holds(d, at)
            return self._holds(expr.value, flow, at, binding_holds) if isinstance(expr, cst.Attribute) else False
        if isinstance(expr, cst.Call):
            func = expr.func
            last = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) \
                else ""
            if last in _STOP_METHODS:
                return False
            q = names.qualified(func) or ""
            if q.startswith("torch.") and not q.startswith(("torch.nn.", "torch.finfo")):
                # torch.full(shape, min), torch.where(m, 0, min), torch.triu(mask), torch.cat(...)
                return any(self._holds(a.value, flow, at, binding_holds) for a in expr.args)
            if isinstance(func, cst.Attribute) and self._tensor_receiver(func.value, flow):
                # a tensor method: values flow from the receiver, and from the fill value of
                # `masked_fill`/`new_full`/`fill_`
                if self._holds(func.value, flow, at, binding_holds):
                    return True
                if last in _VALUE_METHODS:
                    return any(self._holds(a.value, flow, at, binding_holds) for a in expr.args)
            callee = facts_of(self.ctx).calls.callee(expr)
            if callee is not None:
                return self._returns_min(callee.node)  # a helper of this file that builds a mask
            return False  # any other callable: a module, a loss, a helper of another file
        if isinstance(expr, cst.BinaryOperation):
            if isinstance(expr.operator, (cst.BitAnd, cst.BitOr, cst.BitXor, cst.FloorDivide, cst.Modulo)):
                return False
            return self._holds(expr.left, flow, at, binding_holds) or self._holds(expr.right, flow, at, binding_holds)
        if isinstance(expr, cst.Subscript):
            return self._holds(expr.value, flow, at, binding_holds)
        if isinstance(expr, cst.IfExp):
            return self._holds(expr.body, flow, at, binding_holds) or self._holds(expr.orelse, flow, at, binding_holds)
        if isinstance(expr, (cst.List, cst.Tuple)):  # `torch.cat([zeros, mask])`
            return any(self._holds(e.value, flow, at, binding_holds) for e in expr.elements)
        return False

    @staticmethod
    def _tensor_receiver(recv: cst.BaseExpression, flow: FunctionFlow) -> bool:
        """Not `self.helper(...)`, a module function or a global helper: a local value, an
        attribute of one (`self.mask`), a subscript or a call result."""
        if isinstance(recv, cst.Name):
            return recv.value != "self" and (recv.value in flow.params or any(b.name == recv.value for b in flow.bindings))
        if isinstance(recv, cst.Attribute):
            base = recv
            while isinstance(base, cst.Attribute):
                base = base.value
            if isinstance(base, cst.Name):
                return base.value == "self" or base.value in flow.params or \
                    any(b.name == base.value for b in flow.bindings)
        return True

    def _clamped(self, node: cst.CSTNode, flow: FunctionFlow) -> bool:
        """The sum is clamped back into range: inside a clamp call, or its target is clamped later."""
        target = None
        for p in flow.ancestors(node):
            if isinstance(p, cst.Call):
                f = p.func
                last = f.attr.value if isinstance(f, cst.Attribute) else f.value if isinstance(f, cst.Name) else ""
                if last in _CLAMPS:
                    return True
            if isinstance(p, cst.Assign) and len(p.targets) == 1:
                target = dotted_name(p.targets[0].target)
            if isinstance(p, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                break
        if isinstance(node, cst.AugAssign):
            target = dotted_name(node.target)
        if target is None:
            return False
        after = flow.end.get(id(node), flow.pos(node))
        for n in flow.nodes[after + 1:]:
            if isinstance(n, cst.Call):
                f = n.func
                last = f.attr.value if isinstance(f, cst.Attribute) else f.value if isinstance(f, cst.Name) else ""
                if last in _CLAMPS and target in mu.expr_names(n):
                    return True
        return False
