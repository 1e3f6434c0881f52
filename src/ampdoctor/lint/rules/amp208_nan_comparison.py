from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import values as mu
from ampdoctor.lint.semantic.flow import flow_of
from ampdoctor.lint.rule import FixSpec, Rule

# torch functions whose result is always a tensor
_TORCH_TENSOR = {
    "torch.tensor", "torch.as_tensor", "torch.from_numpy", "torch.zeros", "torch.ones", "torch.full",
    "torch.empty", "torch.rand", "torch.randn", "torch.stack", "torch.cat", "torch.sum", "torch.mean",
    "torch.matmul", "torch.exp", "torch.log", "torch.sqrt", "torch.abs", "torch.norm", "torch.linalg.norm",
    "torch.linalg.vector_norm", "torch.where", "torch.clamp", "torch.nn.utils.clip_grad_norm_",
    "torch.zeros_like", "torch.ones_like", "torch.full_like", "torch.empty_like", "torch.randn_like",
}
_CODE = cst.Module([])
# words in an operand's name that say it holds a float a NaN check is about (a loss, a gradient
# norm, a metric): with neither these nor an evident float/tensor type, the value may be an
# integer count or an integer image that cannot be NaN, and the dead check is harmless
_FLOAT_WORDS = ("loss", "grad", "norm", "nan", "inf", "logit", "prob", "score", "metric", "lr", "scale",
                "mean", "std", "var", "avg", "weight", "output", "pred", "error", "err", "value", "val")


class NanComparison(Rule):
    """``x == float('nan')`` is always False: NaN is unequal to everything."""

    code = "AMP208"
    name = "nan-comparison"
    severity = Severity.ERROR
    in_tests = True  # a bug whatever the test intends
    message = ("`{expr}` is always {value}: NaN compares unequal to everything, itself included, so this "
               "check never detects a NaN. Use {use}.")
    fix_title = "Use `{call}`"
    fix_availability = "unsafe"
    words = (b"'nan'", b'"nan"', b".nan", b"NaN", b"NAN")
    also = (b"==", b"!=")
    summary = "`==`/`!=` against NaN (`float('nan')`, `math.nan`, `np.nan`, `torch.nan`), which is constant."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.module: cst.Module | None = None
        self._consts: dict[str, float] | None = None

    def visit_Module(self, node: cst.Module) -> None:
        self.module = node

    def _constants(self) -> dict[str, float]:
        if self._consts is None:
            self._consts = mu.module_constants(self.module, self.ctx.names) if self.module is not None else {}
        return self._consts

    def _is_nan(self, node: cst.CSTNode) -> bool:
        consts = None
        if isinstance(node, cst.Name):
            if self._local(node.value):
                return False
            consts = self._constants()
        return mu.is_nan_constant(self.ctx.names, node, consts)

    def _local(self, name: str) -> bool:
        """``name`` is a parameter or a local of an enclosing function (it shadows a module constant)."""
        fn = h.enclosing_scope(self.ctx)
        if not isinstance(fn, cst.FunctionDef):
            return False
        flow = flow_of(self.ctx, fn)
        return name in flow.params or any(b.name == name for b in flow.bindings)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        left = node.left
        for target in node.comparisons:
            right = target.comparator
            if isinstance(target.operator, (cst.Equal, cst.NotEqual)):
                a, b = self._is_nan(left), self._is_nan(right)
                if a or b:
                    equal = isinstance(target.operator, cst.Equal)
                    other = None if (a and b) or len(node.comparisons) != 1 else (right if a else left)
                    self._report(node, target, equal, other)
            left = right

    def _report(self, node: cst.Comparison, target, equal: bool, other) -> None:
        kind = self._kind(other) if other is not None else None
        if other is not None and kind is None and not _float_named(other) and not self._cleaning_mask(node):
            return  # `den == np.nan` on counts, `im[:, 0] == np.nan` on a uint8 image: may not be a float
        fix = None
        x = _CODE.code_for_node(other).strip() if other is not None else "x"
        if len(x) > 30:
            x = "x"
        use = (f"`{'' if equal else 'not '}math.isnan({x})` for a number or "
               f"`{'' if equal else '~'}torch.isnan({x})` for a tensor")
        if other is not None:
            if kind is None and self._scalar_context():
                kind_for_fix, safe = "float", False
            else:
                kind_for_fix, safe = kind, True
            if kind is not None:
                prefix = "" if equal else ("not " if kind == "float" else "~")
                use = f"`{prefix}{self._call(kind, x)}`"
            if kind_for_fix is not None:
                fix = self._fix(node, other, kind_for_fix, equal, safe)
        if len(node.comparisons) == 1:
            expr = _CODE.code_for_node(node.with_changes(lpar=[], rpar=[])).strip()
        else:
            expr = _CODE.code_for_node(target.operator).strip() + " " + _CODE.code_for_node(target.comparator).strip()
        if len(expr) > 60:
            expr = expr[:57] + "..."
        self.report(node, self.message.format(expr=expr, value="False" if equal else "True", use=use), fix)

    def _cleaning_mask(self, node: cst.Comparison) -> bool:
        """``x[x == nan] = 0.0``: the comparison selects the values an assignment replaces, so the
        code means to clean NaNs out of a float array."""
        parents = self.ctx.parents
        for i in range(len(parents) - 2, 0, -1):
            p = parents[i]
            if isinstance(p, (cst.SubscriptElement, cst.Index)):
                continue
            if isinstance(p, cst.Subscript):
                return isinstance(parents[i - 1], cst.AssignTarget)
            return False
        return False

    def _scalar_context(self) -> bool:
        parents = self.ctx.parents
        node = parents[-1]
        for i in range(len(parents) - 2, -1, -1):
            p = parents[i]
            if isinstance(p, cst.UnaryOperation) and isinstance(p.operator, cst.Not):
                node = p
                continue
            if isinstance(p, cst.BooleanOperation):
                node = p
                continue
            if isinstance(p, (cst.If, cst.While, cst.Assert, cst.IfExp)):
                return p.test is node
            return False
        return False

    def _kind(self, expr) -> str | None:
        """"tensor", "float" or "numpy" when the operand's type is evident, else None."""
        names = self.ctx.names
        if isinstance(expr, cst.Call):
            if h.method_call(expr, "item") and not expr.args:
                return "float"
            q = names.qualified(expr.func)
            if q is None:
                return None
            if q == "float" or q.startswith("math."):
                return "float"
            if q in _TORCH_TENSOR or q.startswith("torch.nn.functional."):
                return "tensor"
            if q.startswith("numpy."):
                return "numpy"
            return None
        if isinstance(expr, cst.Name):
            fn = h.enclosing_scope(self.ctx)
            if not isinstance(fn, cst.FunctionDef):
                return None
            flow = flow_of(self.ctx, fn)
            if expr.value in flow.params:
                return None
            b = flow.binding_at(expr.value, flow.pos(self.ctx.parents[-1]))
            if b is None or b.aug or b.value is None:
                return None
            return self._kind(b.value) if isinstance(b.value, cst.Call) else None
        return None

    def _module(self, kind: str) -> tuple[str, tuple[str, ...]]:
        mod = {"float": "math", "tensor": "torch", "numpy": "numpy"}[kind]
        local = self.ctx.names.local_name_for(mod)
        return (local, ()) if local is not None else (mod, (mod,))

    def _call(self, kind: str, x: str) -> str:
        return f"{self._module(kind)[0]}.isnan({x})"

    def _fix(self, node: cst.Comparison, other, kind: str, equal: bool, safe: bool) -> FixSpec:
        mod, imports = self._module(kind)
        call = cst.Call(func=cst.Attribute(cst.Name(mod), cst.Name("isnan")),
                        args=[cst.Arg(other.with_changes(lpar=[], rpar=[]) if _bare(other) else other)])
        new: cst.BaseExpression = call
        if not equal:
            op = cst.Not() if kind == "float" else cst.BitInvert()
            new = cst.UnaryOperation(operator=op, expression=call)
        new = new.with_changes(lpar=node.lpar, rpar=node.rpar)
        title = self.fix_title.format(call=_CODE.code_for_node(new.with_changes(lpar=[], rpar=[])))
        return FixSpec(((node, new),), safe=safe, title=title, imports=imports)


def _float_named(expr) -> bool:
    """The operand's own name (``loss``, ``self.grad_norm``, ``metric.get()``, ``losses[i]``) says it
    is a float-valued quantity."""
    while True:
        if isinstance(expr, cst.Call):
            expr = expr.func
        elif isinstance(expr, cst.Subscript):
            expr = expr.value
        else:
            break
    if isinstance(expr, cst.Attribute):
        name = expr.attr.value
    elif isinstance(expr, cst.Name):
        name = expr.value
    else:
        return False
    low = name.lower()
    return any(w in low for w in _FLOAT_WORDS)


def _bare(expr) -> bool:
    return isinstance(expr, (cst.Name, cst.Attribute, cst.Call, cst.Subscript))
