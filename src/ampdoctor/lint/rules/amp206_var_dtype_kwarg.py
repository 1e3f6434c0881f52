from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import source
from ampdoctor.lint.rule import FixSpec, Rule

_FUNCTIONS = {"torch.var": "var", "torch.std": "std", "torch.var_mean": "var_mean", "torch.std_mean": "std_mean",
              "torch.Tensor.var": "var", "torch.Tensor.std": "std"}
_CAST = {"float32": "float", "float64": "double", "float16": "half", "bfloat16": "bfloat16"}
_ATOMIC = (cst.Name, cst.Attribute, cst.Call, cst.Subscript)


class VarDtypeKwarg(Rule):
    """``x.var(..., dtype=torch.float32)``: var/std take no dtype and raise TypeError."""

    code = "AMP206"
    name = "var-dtype-kwarg"
    severity = Severity.ERROR
    in_tests = True  # a bug whatever the test intends
    message = ("`{f}()` has no `dtype=` parameter (unlike `mean`/`sum`), so this call raises TypeError. "
               "Convert the input instead: `{fixed}`.")
    fix_title = "Move the dtype onto the input: `{fixed}`"
    fix_availability = "safe"
    words = (b".var(", b".std(", b"var_mean(", b"std_mean(")
    also = (b"dtype",)
    summary = "`var`/`std`/`var_mean`/`std_mean` called with `dtype=`, which raises TypeError."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.pending: list[tuple[cst.Call, str, cst.Call]] = []  # method-form findings
        self.own_methods = False  # the file defines its own var()/std() taking a dtype

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if node.name.value in ("var", "std"):
            ps = node.params
            if any(p.name.value == "dtype" for p in list(ps.params) + list(ps.kwonly_params)) or \
                    isinstance(ps.star_kwarg, cst.Param):
                self.own_methods = True

    def leave_Module(self, node: cst.Module) -> None:
        if self.own_methods:
            return
        for call, what, new_call in self.pending:
            self._report(call, what, new_call)

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        dtype_arg = next((a for a in node.args if a.keyword is not None and a.keyword.value == "dtype"), None)
        if dtype_arg is None:
            return
        q = names.qualified(node.func)
        if q in _FUNCTIONS:
            self._function_form(node, _FUNCTIONS[q], dtype_arg)
            return
        mc = h.method_call(node, "var", "std")
        if mc is None:
            return
        recv, meth = mc
        if q and q.split(".", 1)[0] in ("numpy", "np", "jax", "cupy", "pandas", "scipy", "dask", "mlx"):
            return
        # only a torch dtype proves a torch tensor: numpy's `a.var(dtype=np.float64)` is valid
        dq = names.qualified(dtype_arg.value)
        dt = h.dtype_of(names, dtype_arg.value)
        if dt is None or not (dq or "").startswith("torch."):
            return
        new_recv = _cast(recv, dt, dtype_arg.value)
        new_call = node.with_changes(func=node.func.with_changes(value=new_recv),  # type: ignore[union-attr]
                                     args=_without(node.args, dtype_arg))
        self.pending.append((node, f"{source.short(recv, 20)}.{meth}", new_call))

    def _function_form(self, node: cst.Call, meth: str, dtype_arg: cst.Arg) -> None:
        args = list(node.args)
        if any(a.star for a in args):
            self.report(node, self.message.format(f=source.short(node.func), fixed="torch." + meth + "(x.float(), ...)"))
            return
        inp = next((a for a in args if a.keyword is not None and a.keyword.value in ("input", "self")), None)
        if inp is None:
            inp = next((a for a in args if a.keyword is None), None)
        if inp is None:
            return
        dt = h.dtype_of(self.ctx.names, dtype_arg.value)
        value = inp.value
        if not isinstance(value, _ATOMIC) and not value.lpar:
            value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        new_inp = inp.with_changes(value=_cast(value, dt, dtype_arg.value))
        new_args = [new_inp if a is inp else a for a in _without(args, dtype_arg)]
        self._report(node, source.short(node.func), node.with_changes(args=new_args))

    def _report(self, node: cst.Call, what: str, new_call: cst.Call) -> None:
        fixed = source.short(new_call, 60)
        fix = FixSpec(((node, new_call),), safe=True, title=self.fix_title.format(fixed=fixed))
        self.report(node, self.message.format(f=what, fixed=fixed), fix)


def _cast(expr: cst.BaseExpression, dt: str | None, dtype_expr: cst.BaseExpression) -> cst.Call:
    meth = _CAST.get(dt or "")
    if meth is not None:
        return cst.Call(func=cst.Attribute(value=expr, attr=cst.Name(meth)))
    return cst.Call(func=cst.Attribute(value=expr, attr=cst.Name("to")), args=[cst.Arg(dtype_expr)])


def _without(args, drop: cst.Arg) -> list[cst.Arg]:
    out = [a for a in args if a is not drop]
    if out and args and args[-1] is drop:
        # the dropped argument was last: the new last one keeps the dropped one's comma style
        out[-1] = out[-1].with_changes(comma=drop.comma)
    return out
