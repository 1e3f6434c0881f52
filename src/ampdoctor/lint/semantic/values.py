"""Values: what an expression can hold, followed statically.

Constants folded from literals and module-level names (``-1e9``, ``float("-inf")``,
``torch.finfo(dtype).min``), the float16 range, upcasts, and the shapes of attention
(``softmax`` inputs, matmul operands). Data flow goes through ``semantic.flow``.
"""

from __future__ import annotations

import math

import libcst as cst

from ampdoctor.lint import helpers as h
from ampdoctor.lint import tree
from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.semantic.flow import FunctionFlow

FP16_MAX = 65504.0

_FINFO = {"torch.finfo", "numpy.finfo"}
_WIDE_DTYPES = {
    "torch.float32": "float32", "torch.float": "float32", "torch.float64": "float64", "torch.double": "float64",
    "numpy.float32": "float32", "numpy.float64": "float64", "numpy.single": "float32", "numpy.double": "float64",
}
_WIDE_LIMITS = {"float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}
_INF_NAMES = {"math.inf": math.inf, "torch.inf": math.inf, "numpy.inf": math.inf, "numpy.Inf": math.inf,
              "numpy.infty": math.inf, "numpy.PINF": math.inf, "numpy.NINF": -math.inf}
NAN_NAMES = {"math.nan", "torch.nan", "numpy.nan", "numpy.NaN", "numpy.NAN"}
_FLOAT_INFO = {"sys.float_info.max": 1.7976931348623157e308}


def module_constants(module: cst.Module, names: Names) -> dict[str, float]:
    """Module-level ``NAME = <constant>`` bindings whose name is bound nowhere else in the file."""
    found: dict[str, cst.BaseExpression] = {}
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for s in stmt.body:
                if isinstance(s, cst.Assign) and len(s.targets) == 1 and isinstance(s.targets[0].target, cst.Name):
                    found[s.targets[0].target.value] = s.value
    if not found:
        return {}
    # rebinding at module level, or through `global NAME` in a function, disqualifies a name;
    # parameters and locals only shadow it inside their function (see `local_constants`)
    bound: dict[str, int] = {}
    for n in h.walk(module):
        targets: list[cst.CSTNode] = []
        if isinstance(n, cst.Assign):
            targets = [t.target for t in n.targets]
        elif isinstance(n, (cst.AugAssign, cst.AnnAssign)):
            targets = [n.target]
        elif isinstance(n, (cst.For, cst.CompFor)):
            targets = [n.target]
        elif isinstance(n, (cst.FunctionDef, cst.ClassDef)):
            targets = [n.name]
        for t in targets:
            for leaf in [t, *h.walk(t)]:
                if isinstance(leaf, cst.Name):
                    bound[leaf.value] = bound.get(leaf.value, 0) + 1
    for n in h.walk(module, enter_scopes=True):
        if isinstance(n, cst.Global):
            for g in n.names:
                bound[g.name.value] = 99
    out = {}
    for name, value in found.items():
        if bound.get(name, 0) != 1:
            continue
        v = const_value(names, value)
        if v is not None:
            out[name] = v
    return out


def local_constants(names: Names, flow: FunctionFlow, module_consts: dict[str, float], at: int,
                    guard_words: tuple[str, ...] = ()) -> dict[str, float]:
    """The constants visible at preorder index ``at`` of a function: module constants not
    shadowed there, plus locals bound exactly once to a constant before ``at`` (outside any
    ``if`` whose test mentions one of ``guard_words``)."""
    local_names = set(flow.params) | {b.name for b in flow.bindings}
    out = {k: v for k, v in module_consts.items() if k not in local_names}
    counts: dict[str, int] = {}
    for b in flow.bindings:
        counts[b.name] = counts.get(b.name, 0) + 1
    for b in flow.bindings:
        if counts[b.name] != 1 or b.aug or b.value is None or b.name in flow.params or b.end >= at:
            continue
        stmt = flow.nodes[b.start]
        if guard_words and any(isinstance(p, (cst.If, cst.IfExp)) and
                               any(w in " ".join(h.names_in(p.test)) for w in guard_words)
                               for p in flow.ancestors(stmt)):
            continue
        v = const_value(names, b.value, out)
        if v is not None:
            out[b.name] = v
    return out


def _finfo_limit(names: Names, node: cst.CSTNode) -> float | None:
    """``torch.finfo(torch.float32).min`` -> -3.4e38; None when the dtype is not a literal wide one."""
    if not (isinstance(node, cst.Attribute) and node.attr.value in ("min", "max") and isinstance(node.value, cst.Call)):
        return None
    call = node.value
    if names.qualified(call.func) not in _FINFO:
        return None
    dt = h.arg(call, 0, "type")
    if dt is None and not call.args:
        kind = "float32"  # the default dtype
    else:
        kind = _WIDE_DTYPES.get(names.qualified(dt) or "")
    if kind is None:
        return None
    lim = _WIDE_LIMITS[kind]
    return -lim if node.attr.value == "min" else lim


def const_value(names: Names, node: cst.CSTNode | None, consts: dict[str, float] | None = None) -> float | None:
    """Fold a numeric constant: literals, ``float("-inf")``, ``2**30``, ``-1e4 * 1e5``,
    ``math.inf``, ``torch.finfo(torch.float32).min``, module constants; else None."""
    if node is None:
        return None
    v = h.number_value(node)
    if v is not None:
        return v
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
        v = const_value(names, node.expression, consts)
        if v is None:
            return None
        return -v if isinstance(node.operator, cst.Minus) else v
    if isinstance(node, cst.BinaryOperation):
        a = const_value(names, node.left, consts)
        b = const_value(names, node.right, consts)
        if a is None or b is None:
            return None
        op = node.operator
        try:
            if isinstance(op, cst.Add):
                return a + b
            if isinstance(op, cst.Subtract):
                return a - b
            if isinstance(op, cst.Multiply):
                return a * b
            if isinstance(op, cst.Divide) and b != 0:
                return a / b
            if isinstance(op, cst.Power) and abs(b) <= 1024:
                return float(a ** b)
        except (OverflowError, ZeroDivisionError, ValueError):
            return None
        return None
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value in ("float", "int") \
            and len(node.args) == 1 and node.func.value not in names.aliases:
        return const_value(names, node.args[0].value, consts)
    if isinstance(node, cst.Attribute):
        lim = _finfo_limit(names, node)
        if lim is not None:
            return lim
        q = names.qualified(node)
        if q in _INF_NAMES:
            return _INF_NAMES[q]
        if q in NAN_NAMES:
            return math.nan
        if q in _FLOAT_INFO:
            return _FLOAT_INFO[q]
        return None
    if isinstance(node, cst.Name) and consts and node.value in consts:
        return consts[node.value]
    return None


def is_nan_constant(names: Names, node: cst.CSTNode, consts: dict[str, float] | None = None) -> bool:
    if isinstance(node, (cst.Attribute, cst.Name)) and names.qualified(node) in NAN_NAMES:
        return True
    v = const_value(names, node, consts)
    return v is not None and math.isnan(v)


def is_finfo_min(names: Names, node: cst.CSTNode) -> bool:
    """``torch.finfo(<anything>).min``."""
    return isinstance(node, cst.Attribute) and node.attr.value == "min" and isinstance(node.value, cst.Call) \
        and names.qualified(node.value.func) == "torch.finfo"


# -- function-level data flow -----------------------------------------------------------

def expr_names(node: cst.CSTNode) -> set[str]:
    """Dotted names read by an expression (``x``, ``self.mask``), nested lambdas included."""
    out: set[str] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, (cst.Name, cst.Attribute)):
            d = dotted_name(n)
            if d is not None:
                out.add(d)
                if isinstance(n, cst.Attribute):
                    # `x.shape`, `self.mask` : also the base names
                    base = n.value
                    while isinstance(base, cst.Attribute):
                        bd = dotted_name(base)
                        if bd:
                            out.add(bd)
                        base = base.value
                    if isinstance(base, cst.Name):
                        out.add(base.value)
                continue
        if isinstance(n, cst.Attribute):
            todo.append(n.value)
            continue
        todo.extend(tree.children(n))
    return out


UPCAST_METHODS = ("float", "double")
_FP32 = ("float32", "float64")


def is_upcast(names: Names, node: cst.CSTNode) -> bool:
    """``x.float()``, ``x.double()``, ``x.to(torch.float32)``, ``x.to(dtype=torch.float32)``,
    ``x.type(torch.float32)``: an explicit cast to a wide float type."""
    mc = h.method_call(node, "float", "double", "to", "type")
    if mc is None:
        return False
    _, meth = mc
    call: cst.Call = node  # type: ignore[assignment]
    if meth in UPCAST_METHODS:
        return not call.args
    for a in call.args:
        if a.keyword is None or a.keyword.value == "dtype":
            if h.dtype_of(names, a.value) in _FP32:
                return True
    return False


def contains_upcast(names: Names, node: cst.CSTNode) -> bool:
    return is_upcast(names, node) or any(is_upcast(names, n) for n in h.walk(node, enter_scopes=True))


# -- softmax and matmul ---------------------------------------------------------------------

_SOFTMAX_FUNCS = {"torch.softmax", "torch.nn.functional.softmax", "torch.special.softmax", "torch.log_softmax",
                  "torch.nn.functional.log_softmax", "torch.special.log_softmax"}
_SOFTMAX_MODULES = {"torch.nn.Softmax", "torch.nn.LogSoftmax", "torch.nn.modules.activation.Softmax",
                    "torch.nn.modules.activation.LogSoftmax"}
_MATMUL_FUNCS = {"torch.matmul", "torch.bmm", "torch.mm", "torch.einsum", "torch.baddbmm", "torch.functional.einsum"}


def softmax_input(names: Names, node: cst.CSTNode) -> cst.BaseExpression | None:
    """The tensor a softmax call normalises: ``torch.softmax(x, ...)``, ``F.softmax(x)``,
    ``x.softmax(dim)``, ``self.softmax(x)`` for an ``nn.Softmax`` module, and ``log_softmax``."""
    if not isinstance(node, cst.Call):
        return None
    q = names.qualified(node.func)
    if q in _SOFTMAX_FUNCS:
        return h.arg(node, 0, "input")
    if names.made_by(node.func) in _SOFTMAX_MODULES:
        return h.arg(node, 0, "input")
    mc = h.method_call(node, "softmax", "log_softmax")
    if mc is not None and dotted_name(mc[0]) != "self":
        return mc[0]
    return None


def matmul_operands(names: Names, node: cst.CSTNode) -> list[cst.BaseExpression] | None:
    """The tensor operands of ``a @ b``, ``torch.matmul/bmm/mm/baddbmm(...)``, ``torch.einsum(eq, a, b)``
    and ``a.matmul(b)``/``a.bmm(b)``; None for anything else."""
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.MatrixMultiply):
        return [node.left, node.right]
    if not isinstance(node, cst.Call):
        return None
    q = names.qualified(node.func)
    if q in _MATMUL_FUNCS:
        args = [a.value for a in node.args if a.keyword is None and not a.star]
        if q.endswith("einsum"):
            return args[1:] if len(args) >= 3 else None
        if q.endswith("baddbmm"):
            return args[1:3] if len(args) >= 3 else None
        return args if len(args) >= 2 else None
    mc = h.method_call(node, "matmul", "bmm", "mm")
    if mc is not None and len(node.args) == 1 and q not in _MATMUL_FUNCS:
        return [mc[0], node.args[0].value]
    return None
