from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import models as nu
from ampdoctor.lint.semantic import casts as conv
from ampdoctor.lint.semantic.flow import Assignment, FunctionFlow, flow_of
from ampdoctor.lint.semantic import source
from ampdoctor.lint.rule import FixSpec, Rule

# tensor methods / torch functions that keep a float32 input float32 (no autocast lowering)
_KEEPS_DTYPE = {
    "add", "sub", "mul", "div", "neg", "abs", "pow", "sqrt", "rsqrt", "exp", "log", "clamp", "clamp_min",
    "clamp_max", "mean", "sum", "var", "std", "square", "reciprocal", "tanh", "sigmoid", "where", "masked_fill",
    "unsqueeze", "squeeze", "view", "reshape", "transpose", "permute", "contiguous", "expand", "flatten",
    "unflatten", "chunk", "split", "cat", "stack", "softmax", "log_softmax", "amax", "amin", "max", "min",
    "sign", "erf", "cumsum", "roll", "flip", "repeat", "narrow", "select", "gather", "addcmul", "lerp",
    "mul_", "add_", "div_", "sub_", "clamp_", "pow_", "maximum", "minimum", "nan_to_num", "norm", "relu",
    "gelu", "silu", "softplus", "float",
}
_NAMES = ("input_dtype", "orig_dtype", "in_dtype")


@dataclass
class _Rebind:
    stmt: cst.Assign
    name: str
    promoted_by: str | None  # the float32 name it mixes in (promotion form), None for x.float()


class DtypeRestoreAfterRebind(Rule):
    """``x = x.float()`` ... ``return y.to(x.dtype)``: the "restore" casts to float32."""

    code = "AMP207"
    name = "dtype-restore-after-rebind"
    severity = Severity.WARNING
    message = ("`{restore}` casts to float32, not back to the input's dtype: `{x}` was rebound to {how}, "
               "so float16/bfloat16 inputs come out as float32. Save `{x}.dtype` before the upcast "
               "and cast back to that.")
    fix_title = "Save `{v} = {x}.dtype` before the upcast and cast back to `{v}`"
    fix_availability = "safe"
    words = (b".dtype)", b"type_as(", b"=x.dtype", b".dtype,")
    also = (b".float()", b"float32", b".double()", b"torch.float)")
    summary = "`x = x.float()` followed by `.to(x.dtype)`, which then no longer restores the input dtype."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._restoring: set[int] = set()  # functions (and their enclosing ones) with a restore call

    def visit_Call(self, node: cst.Call) -> None:
        if self._restore(node) is not None:
            h.mark_enclosing_functions(self.ctx, self._restoring)

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        if id(node) not in self._restoring:
            return  # no `.to(x.dtype)`/`.type_as(x)` in it: nothing to report, no index to build
        idx = flow_of(self.ctx, node)
        rebinds: dict[int, _Rebind] = {}
        for name, assigns in idx.assigns.items():
            if "." in name:
                continue
            for a in assigns:
                if isinstance(a.stmt, cst.Assign) and len(a.stmt.targets) == 1 and a.value is not None:
                    r = self._rebind(idx, name, a.stmt)
                    if r is not None:
                        rebinds[id(a.stmt)] = r
        if not rebinds:
            return
        returned = self._returned_names(idx)
        found: dict[int, list[tuple[cst.Call, cst.CSTNode]]] = {}  # rebind stmt -> restores
        for n in idx.nodes:
            res = self._restore(n)
            if res is None:
                continue
            x, dtype_node = res
            if not self._in_result(idx, n, returned):
                continue
            up = self._trace(idx, x, n, rebinds, 0)
            if up is None:
                continue
            if self._saved_before(idx, x, up.stmt):
                continue
            assert isinstance(n, cst.Call)
            if not self._depends_on(idx, n.func.value, x, n):  # type: ignore[union-attr]
                continue
            found.setdefault(id(up.stmt), []).append((n, dtype_node))
        for key, restores in found.items():
            r = rebinds[key]
            fix = self._fix(idx, node, r, restores)
            how = (f"a float32 result (it mixes in `{r.promoted_by}`, computed in float32)" if r.promoted_by
                   else f"float32 by `{source.short(r.stmt, 40)}`")
            for call, _ in restores:
                args = source.short(call.with_changes(func=cst.Name("_")), 40)[1:]
                restore = "." + call.func.attr.value + args  # type: ignore[union-attr]
                self.report(call, self.message.format(x=r.name, how=how, restore=restore), fix)

    # -- recognising the pieces ----------------------------------------------------------------
    def _rebind(self, idx: FunctionFlow, x: str, stmt: cst.Assign) -> _Rebind | None:
        value = stmt.value
        names = self.ctx.names
        # explicit form: x = x.float() / x.to(torch.float32) / x.type(torch.float32), in a chain
        chain = value
        casts = []
        while isinstance(chain, cst.Call) and isinstance(chain.func, cst.Attribute):
            casts.append(conv.cast_target(names, chain))
            chain = chain.func.value
        if isinstance(chain, cst.Name) and chain.value == x and casts:
            last = next((c for c in casts if c is not None), None)  # outermost conversion wins
            if last in conv.UPCAST:
                return _Rebind(stmt, x, None)
            return None
        # promotion form: x = (x - mean) / torch.sqrt(var + eps) with mean computed in float32
        if not isinstance(value, cst.BinaryOperation):
            return None
        if x not in nu.names_in_expr(value) or conv.has_downcast(names, value) or conv.has_upcast(names, value):
            return None
        for n in nu.names_in_expr(value):
            if n == x:
                continue
            for a in idx.reaching(n, stmt):
                if a.value is not None and self._fp32_tensor(a.value):
                    return _Rebind(stmt, x, n)
        return None

    def _fp32_tensor(self, value: cst.BaseExpression) -> bool:
        """A value computed in float32 that keeps a dimension (so it promotes what it meets)."""
        names = self.ctx.names
        if not isinstance(value, cst.Call):
            return False
        if conv.cast_target(names, value) in conv.UPCAST:
            return True
        if conv.dtype_kwarg(names, value) in conv.UPCAST:
            # a reduction with dtype=torch.float32 over a dim (a 0-dim result would not promote)
            return h.arg(value, 0, "dim") is not None
        mc = h.method_call(value, *_KEEPS_DTYPE)
        if mc is not None and conv.has_upcast(names, mc[0]):
            return h.arg(value, 0, "dim") is not None or mc[1] not in ("mean", "sum", "var", "std", "amax", "amin")
        return False

    def _restore(self, n: cst.CSTNode) -> tuple[str, cst.CSTNode] | None:
        """``.to(x.dtype)``/``.to(dtype=x.dtype)``/``.type(x.dtype)`` -> (x, the ``x.dtype`` node);
        ``.type_as(x)`` -> (x, the call)."""
        mc = h.method_call(n, "to", "type", "type_as")
        if mc is None:
            return None
        assert isinstance(n, cst.Call)
        if mc[1] == "type_as":
            if len(n.args) == 1 and isinstance(n.args[0].value, cst.Name) and n.args[0].keyword is None:
                return n.args[0].value.value, n
            return None
        for a in n.args:
            if a.keyword is not None and a.keyword.value != "dtype":
                continue
            v = a.value
            if isinstance(v, cst.Attribute) and v.attr.value == "dtype" and isinstance(v.value, cst.Name):
                return v.value.value, v
        return None

    def _returned_names(self, idx: FunctionFlow) -> set[str]:
        out = set()
        for n in idx.nodes:
            if isinstance(n, cst.Return) and n.value is not None:
                vals = n.value.elements if isinstance(n.value, cst.Tuple) else [n.value]
                for v in vals:
                    v = v.value if isinstance(v, cst.BaseElement) else v
                    if isinstance(v, cst.Name):
                        out.add(v.value)
        return out

    def _in_result(self, idx: FunctionFlow, n: cst.CSTNode, returned: set[str]) -> bool:
        """The restore is part of what the function returns (a return statement, or a name
        assigned here and returned as such)."""
        for p in idx.ancestors(n):
            if isinstance(p, cst.Return):
                return True
            if isinstance(p, cst.Assign):
                return any(isinstance(t.target, cst.Name) and t.target.value in returned for t in p.targets)
            if isinstance(p, (cst.BaseCompoundStatement, cst.Lambda)):
                return False
        return False

    def _trace(self, idx: FunctionFlow, x: str, at: cst.CSTNode, rebinds: dict[int, _Rebind],
               depth: int) -> Assignment | None:
        """The upcast that every definition of ``x`` reaching ``at`` comes from (through
        float32-preserving reassignments such as ``x = x * torch.rsqrt(...)``), else None."""
        reaching = idx.reaching(x, at)
        if not reaching or depth > 6:
            return None
        found = None
        for a in reaching:
            if id(a.stmt) in rebinds:
                up = a
            elif self._keeps(idx, x, a):
                up = self._trace(idx, x, a.stmt, rebinds, depth + 1)
                if up is None:
                    return None
            else:
                return None
            if found is None or up.order > found.order:
                found = up
        return found

    def _keeps(self, idx: FunctionFlow, x: str, a: Assignment) -> bool:
        """A later assignment of ``x`` that keeps it float32: arithmetic on ``x`` itself."""
        v = a.value
        if v is None or x not in nu.names_in_expr(v):
            return False
        names = self.ctx.names
        for n in [v, *h.walk(v)]:
            if not isinstance(n, cst.Call):
                continue
            if conv.cast_target(names, n) is not None:
                return False
            if not isinstance(n.func, cst.Attribute) or n.func.attr.value not in _KEEPS_DTYPE:
                return False
            base = n.func.value
            if isinstance(base, cst.Name) and base.value in names.aliases \
                    and not names.aliases[base.value].startswith("torch"):
                return False  # a function of another module (np.sqrt); torch.* and F.* are fine
            continue
        return True

    def _saved_before(self, idx: FunctionFlow, x: str, stmt: cst.CSTNode) -> bool:
        at = idx.pos(stmt)
        for n in idx.nodes[:at]:
            if isinstance(n, cst.Attribute) and n.attr.value == "dtype" and isinstance(n.value, cst.Name) \
                    and n.value.value == x:
                return True
        return False

    def _depends_on(self, idx: FunctionFlow, expr: cst.CSTNode, x: str, at: cst.CSTNode, depth: int = 0) -> bool:
        names = nu.names_in_expr(expr)
        if x in names:
            return True
        if depth >= 3:
            return False
        for n in set(names):
            for a in idx.reaching(n, at):
                if a.value is not None and self._depends_on(idx, a.value, x, a.stmt, depth + 1):
                    return True
        return False

    # -- the fix ---------------------------------------------------------------------------------
    def _fix(self, idx: FunctionFlow, fn: cst.FunctionDef, r: _Rebind,
             restores: list[tuple[cst.Call, cst.CSTNode]]) -> FixSpec | None:
        used = {n.value for n in h.walk(fn, enter_scopes=True) if isinstance(n, cst.Name)}
        var = next((v for v in _NAMES if v not in used), None)
        if var is None:
            return None
        line = idx.parent.get(id(r.stmt))
        if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
            return None
        block = idx.parent.get(id(line))
        if not isinstance(block, cst.IndentedBlock):
            return None
        for call, _ in restores:
            if not any(p is block for p in idx.ancestors(call)):
                return None  # the upcast is in a branch the restore does not always follow
        save = cst.parse_statement(f"{var} = {r.name}.dtype\n")
        save = save.with_changes(leading_lines=line.leading_lines)
        changes: list = [(line, cst.FlattenSentinel([save, line.with_changes(leading_lines=())]))]
        for call, dnode in restores:
            if dnode is call:  # .type_as(x) -> .to(var)
                changes.append((call, call.with_changes(func=call.func.with_changes(attr=cst.Name("to")),  # type: ignore[union-attr]
                                                        args=[cst.Arg(cst.Name(var))])))
            else:
                changes.append((dnode, cst.Name(var)))
        return FixSpec(tuple(changes), safe=True, title=self.fix_title.format(v=var, x=r.name))
