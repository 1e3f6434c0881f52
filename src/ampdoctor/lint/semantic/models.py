"""Models and optimizers: which models are made float16, which optimizers train their
parameters, the default dtype, and the small numeric helpers of the numerics rules."""

from __future__ import annotations

import re
from dataclasses import dataclass

import libcst as cst
from ampdoctor.lint import tree as _tree

from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.semantic.casts import _self_and_walk, cast_target, dtype_kwarg, has_upcast, possible_dtypes
from ampdoctor.lint.rule import Context, Rule
from ampdoctor.lint.semantic import vocabulary as voc

# The smallest positive float16 value (a subnormal). Anything below it is 0 (or that one
# subnormal) in float16: `torch.tensor(1e-8, dtype=torch.float16) == 0`.
FP16_TINY = 2.0 ** -24


def is_tiny(v: float | None) -> bool:
    return v is not None and 0.0 < v < FP16_TINY


def fmt_number(v: float) -> str:
    return f"{v:g}"


# -- dtype conversions: semantic.casts ------------------------------------------------------

# -- a per-function index: order, parents, assignments ---------------------------------------

def enclosing_class_of_method(ctx: Context) -> cst.ClassDef | None:
    """The class whose method holds the current node (one function level only)."""
    seen_fn = False
    for p in ctx.ancestors():
        if isinstance(p, cst.FunctionDef):
            if seen_fn:
                return None
            seen_fn = True
        elif isinstance(p, cst.ClassDef):
            return p if seen_fn else None
        elif isinstance(p, cst.Lambda):
            continue
    return None


def param_default(fn: cst.FunctionDef | None, name: str) -> cst.BaseExpression | None | bool:
    """The default of parameter ``name`` of ``fn``; False when ``fn`` has no such parameter,
    None when it has one without a default."""
    if fn is None:
        return False
    ps = fn.params
    for p in list(ps.posonly_params) + list(ps.params) + list(ps.kwonly_params):
        if p.name.value == name:
            return p.default
    for p in (ps.star_arg, ps.star_kwarg):
        if isinstance(p, cst.Param) and p.name.value == name:
            return None
    return False


# -- optimizers ----------------------------------------------------------------------------

TORCH_OPTIMIZER_EPS = {
    "Adam": 1e-8, "AdamW": 1e-8, "NAdam": 1e-8, "RAdam": 1e-8, "Adamax": 1e-8, "SparseAdam": 1e-8,
    "RMSprop": 1e-8, "Adagrad": 1e-10,
}
# position of `eps` among the positional parameters (params first)
TORCH_OPTIMIZER_EPS_POS = {
    "Adam": 3, "AdamW": 3, "NAdam": 3, "RAdam": 3, "Adamax": 3, "SparseAdam": 3, "RMSprop": 3, "Adagrad": 5,
}
_OPTIMIZER_NAMES = {
    "Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop",
    "LBFGS", "SparseAdam", "Adafactor", "Lion", "LAMB", "Lamb", "FusedAdam", "FusedLAMB", "FusedSGD",
    "FusedNovoGrad", "AdamW8bit", "Adam8bit", "PagedAdamW", "PagedAdamW8bit", "Lion8bit", "Muon",
}


def torch_optimizer_name(q: str | None) -> str | None:
    """``torch.optim.Adam`` -> ``Adam`` (only torch.optim classes)."""
    if not q:
        return None
    for prefix in ("torch.optim.", ):
        if q.startswith(prefix):
            last = q.rsplit(".", 1)[-1]
            mid = q[len(prefix):]
            if last[:1].isupper() and not mid.startswith(("lr_scheduler", "swa_utils")) and last != "Optimizer":
                return last
    return None


def is_optimizer_class(q: str | None) -> bool:
    if not q:
        return False
    if torch_optimizer_name(q):
        return True
    last = q.rsplit(".", 1)[-1]
    return last in _OPTIMIZER_NAMES and ("optim" in q.lower() or q == last or q.startswith(("transformers.", "timm.", "apex.", "bitsandbytes.", "bnb.")))


def optimizer_params_arg(call: cst.Call) -> cst.BaseExpression | None:
    return h.arg(call, 0, "params")


def parameter_receivers(expr: cst.CSTNode) -> list[str]:
    """Dotted receivers of ``R.parameters()`` / ``R.named_parameters()`` inside ``expr``."""
    out = []
    for n in _self_and_walk(expr):
        mc = h.method_call(n, "parameters", "named_parameters")
        if mc is not None:
            d = dotted_name(mc[0])
            if d is not None:
                out.append(d)
    return out


def names_in_expr(expr: cst.CSTNode) -> list[str]:
    """Free variable names read in ``expr``: no attribute parts, no keyword names."""
    out: list[str] = []
    stack = [expr]
    while stack:
        n = stack.pop()
        if isinstance(n, cst.Name):
            out.append(n.value)
            continue
        if isinstance(n, cst.Attribute):
            stack.append(n.value)
            continue
        if isinstance(n, cst.Arg):
            stack.append(n.value)
            continue
        if isinstance(n, h.SCOPES):
            continue
        stack.extend(reversed(_tree.children(n)))
    return out


# -- fp16 models (AMP205, AMP210, AMP212) -------------------------------------------------------

MODULE_CHAIN = {"cuda", "to", "half", "cpu", "train", "eval", "float", "bfloat16", "double", "requires_grad_",
                "xpu", "mps", "npu", "share_memory", "apply", "zero_grad"}


def is_fp16_conversion(names: Names, call: cst.CSTNode) -> bool:
    return isinstance(call, cst.Call) and cast_target(names, call) == "float16"


def conversion_result(ctx: Context, call: cst.Call) -> tuple[list[str], cst.CSTNode | None, bool] | None:
    """For a dtype conversion call being visited (``m.half()``, ``m.cuda().half()``,
    ``model = Net().half().cuda()``): the dotted names that hold the converted module, the
    statement, and whether the chain ends in float16. None when the result is not bound to a
    name nor used as a statement (a tensor expression)."""
    names = ctx.names
    stack = ctx.parents
    # climb module-returning method calls: call -> Attribute(value=call) -> Call(func=that)
    i = len(stack) - 1
    outer = call
    final = "float16" if is_fp16_conversion(names, call) else cast_target(names, call)
    while i >= 2:
        attr, up = stack[i - 1], stack[i - 2]
        if isinstance(attr, cst.Attribute) and attr.value is outer and isinstance(up, cst.Call) and up.func is attr \
                and attr.attr.value in MODULE_CHAIN:
            t = cast_target(names, up)
            if t is not None:
                final = t
            outer = up
            i -= 2
            continue
        break
    parent = stack[i - 1] if i >= 1 else None
    targets: list[str] = []
    # receiver root of the chain: Module.half()/.to() convert in place
    recv = call.func.value if isinstance(call.func, cst.Attribute) else None
    while isinstance(recv, cst.Call) and isinstance(recv.func, cst.Attribute) and recv.func.attr.value in MODULE_CHAIN:
        recv = recv.func.value
    root = dotted_name(recv) if recv is not None else None
    if isinstance(parent, cst.Expr):
        if root is None:
            return None
        targets.append(root)
        return targets, parent, final == "float16"
    if isinstance(parent, cst.Assign) and parent.value is outer and len(parent.targets) == 1:
        d = dotted_name(parent.targets[0].target)
        if d is None:
            return None
        targets.append(d)
        if root is not None and root != d:
            targets.append(root)
        return targets, parent, final == "float16"
    return None


T5_RE = re.compile(r"(?<![a-z0-9])(?:flan-|flan_|m|um|long|by)?t5(?![0-9])", re.I)
LONGT5_RE = re.compile(r"(?<![a-z0-9])long-?t5(?![0-9])", re.I)


def t5_kind(text: str | None) -> str | None:
    """"longt5" or "t5" when a class name or checkpoint string names a T5-family model."""
    if not text:
        return None
    if LONGT5_RE.search(text):
        return "longt5"
    if T5_RE.search(text):
        return "t5"
    return None


@dataclass
class Conversion:
    node: cst.Call
    targets: list[str]
    fp16: bool  # the chain ends in float16 (else: another dtype, a reset)
    scope: int
    cls_scope: int
    order: int
    branches: tuple


@dataclass
class OptimizerCall:
    node: cst.Call
    qualified: str
    receivers: list[str]  # dotted R of R.parameters() feeding it (names resolved one level)
    fp16_tensors: list[str]  # names of float16 tensors passed directly (`Adam([latents])`)
    scope_fn: int
    scope_cls: int
    order: int
    branches: tuple


@dataclass
class DefaultDtypeSet:
    node: cst.Call
    fp16: bool
    scope: int
    order: int
    restored_in_finally: bool


_MASTER_WEIGHT_WORDS = {"FP16_Optimizer", "FP16Optimizer", "MemoryEfficientFP16Optimizer", "master_params",
                        "master_weights", "fp32_params", "MixedPrecisionOptimizer", "network_to_half",
                        "prep_param_lists", "model_grads_to_master_grads", "master_params_to_model_params"}


def scope_keys(ctx: Context) -> tuple[int, int]:
    """(id of the innermost function or module, id of the class of that method or 0)."""
    fn = None
    for p in ctx.ancestors():
        if isinstance(p, (cst.FunctionDef, cst.Lambda)):
            fn = p
            break
    cls = enclosing_class_of_method(ctx)
    return (id(fn) if fn is not None else 0), (id(cls) if cls is not None else 0)


class Fp16ModelTracker:
    """Finds optimizers built over the parameters of a model made float16 in the same
    function (or, for ``self.*`` attributes, the same class) before the optimizer."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.conversions: list[Conversion] = []
        self.optimizers: list[OptimizerCall] = []
        self.param_names: dict[tuple[int, str], list[str]] = {}  # (scope, name) -> receivers
        self.fp16_tensors: set[tuple[int, str]] = set()  # (scope, name) of float16 leaf tensors
        self.default_sets: list[DefaultDtypeSet] = []
        self.master_weights = False
        self.scaler = False
        self._n = 0
        self.dtype_vars: dict[tuple[int, str], set[str]] = {}  # (scope, name) -> dtypes it may hold

    def _order(self) -> int:
        self._n += 1
        return self._n

    def visit_Name(self, node: cst.Name) -> None:
        if node.value in _MASTER_WEIGHT_WORDS:
            self.master_weights = True

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value in _MASTER_WEIGHT_WORDS:
            self.master_weights = True

    def visit_Call(self, node: cst.Call) -> None:
        ctx = self.ctx
        names = ctx.names
        q = names.qualified(node.func)
        if q is not None:
            last = q.rsplit(".", 1)[-1]
            if last in voc.GRAD_SCALERS:
                self.scaler = True
            if q in ("apex.amp.initialize", "amp.initialize") or q.startswith("deepspeed.initialize"):
                self.master_weights = True
            if q in ("torch.set_default_dtype", "torch.set_default_tensor_type") and node.args:
                a = node.args[0].value
                fp16 = (h.dtype_of(names, a) == "float16" if q.endswith("dtype")
                        else (names.qualified(a) or h.string_value(a) or "").endswith("HalfTensor"))
                fn_scope, _ = scope_keys(ctx)
                self.default_sets.append(DefaultDtypeSet(node, fp16, fn_scope, self._order(), self._in_try_finally()))
            if last == "from_pretrained":
                self._loaded_in_fp16(node)
            if is_optimizer_class(q):
                params = optimizer_params_arg(node)
                recv: list[str] = []
                tensors: list[str] = []
                fn_scope, cls_scope = scope_keys(ctx)
                if params is not None and not has_upcast(names, params):  # float32 master copies
                    recv = parameter_receivers(params)
                    for n in names_in_expr(params):
                        recv.extend(self.param_names.get((fn_scope, n), ()))
                    tensors = [n for n in _direct_tensor_names(params) if (fn_scope, n) in self.fp16_tensors]
                self.optimizers.append(OptimizerCall(node, q, recv, tensors, fn_scope, cls_scope, self._order(),
                                                     h.branch_path(ctx)))
                return
        t = cast_target(names, node)
        if t is None or t == "?":
            return
        res = conversion_result(ctx, node)
        if res is None:
            return
        targets, _stmt, fp16 = res
        fn_scope, cls_scope = scope_keys(ctx)
        self.conversions.append(Conversion(node, targets, fp16, fn_scope, cls_scope, self._order(),
                                           h.branch_path(ctx)))

    def _loaded_in_fp16(self, call: cst.Call) -> None:
        """``model = X.from_pretrained(..., torch_dtype=torch.float16)`` (or a dtype variable that
        may be float16): the weights are float16 as loaded."""
        value = h.arg(call, None, "torch_dtype") or h.arg(call, None, "dtype")
        if value is None:
            return
        fn_scope, cls_scope = scope_keys(self.ctx)
        dts = possible_dtypes(self.ctx.names, value)
        if isinstance(value, cst.Name):
            dts |= self.dtype_vars.get((fn_scope, value.value), set())
        if "float16" not in dts:
            return
        stack = self.ctx.parents
        parent = stack[-2] if len(stack) >= 2 else None
        if isinstance(parent, cst.Assign) and parent.value is call and len(parent.targets) == 1:
            d = dotted_name(parent.targets[0].target)
            if d is not None:
                self.conversions.append(Conversion(call, [d], True, fn_scope, cls_scope, self._order(),
                                                   h.branch_path(self.ctx)))

    def _in_try_finally(self) -> bool:
        return h.in_try_finally(self.ctx) is not None

    def leave_Assign(self, node: cst.Assign) -> None:
        fn_scope, _ = scope_keys(self.ctx)
        fp16 = is_fp16_leaf(self.ctx.names, node.value)
        dts = possible_dtypes(self.ctx.names, node.value)
        for t in node.targets:
            if isinstance(t.target, cst.Name):
                self.dtype_vars[(fn_scope, t.target.value)] = dts
                if fp16:
                    self.fp16_tensors.add((fn_scope, t.target.value))
                else:
                    self.fp16_tensors.discard((fn_scope, t.target.value))
        recv = parameter_receivers(node.value)
        if not recv or has_upcast(self.ctx.names, node.value):
            return
        for t in node.targets:
            d = dotted_name(t.target)
            if d is not None:
                self.param_names[(fn_scope, d)] = recv

    # -- queries --------------------------------------------------------------------------
    def fp16_matches(self) -> list[tuple[Conversion, OptimizerCall, str]]:
        """(fp16 conversion, optimizer over its parameters, the converted name) pairs."""
        if self.master_weights:
            return []
        out = []
        for c in self.conversions:
            if not c.fp16:
                continue
            for o in self.optimizers:
                if o.order < c.order or h.exclusive(c.branches, o.branches):
                    continue
                t = self._match(c, o)
                if t is None or self._reset_between(t, c, o):
                    continue
                out.append((c, o, t))
        return out

    def _match(self, c: Conversion, o: OptimizerCall) -> str | None:
        for t in c.targets:
            same_scope = c.scope == o.scope_fn
            if t.startswith("self."):
                same_scope = same_scope or (o.scope_cls != 0 and c.cls_scope == o.scope_cls)
            if not same_scope:
                continue
            if any(r == t or r.startswith(t + ".") for r in o.receivers):
                return t
        return None

    def _reset_between(self, t: str, c: Conversion, o: OptimizerCall) -> bool:
        for r in self.conversions:
            if r.fp16 or not (c.order < r.order < o.order):
                continue
            if any(x == t or t.startswith(x + ".") for x in r.targets) and not h.exclusive(r.branches, o.branches):
                return True
        return False

    def default_fp16_before(self, o: OptimizerCall) -> DefaultDtypeSet | None:
        """An unrestored ``set_default_dtype(torch.float16)`` before optimizer ``o``."""
        last = None
        for s in self.default_sets:
            if s.order > o.order:
                break
            if s.scope != o.scope_fn and s.scope != 0:
                continue
            if s.restored_in_finally and s.fp16:
                continue
            last = s
        return last if last is not None and last.fp16 else None


_TENSOR_CHAIN = {"requires_grad_", "to", "cuda", "detach", "clone", "contiguous", "half"}
_PARAMETER = {"torch.nn.Parameter", "torch.nn.parameter.Parameter", "nn.Parameter"}


def is_fp16_leaf(names: Names, value: cst.BaseExpression) -> bool:
    """A float16 tensor made to be optimised: ``torch.randn(..., dtype=torch.float16,
    requires_grad=True)``, ``nn.Parameter(x.half())``, ``x.half().requires_grad_()``."""
    if isinstance(value, cst.Call) and names.qualified(value.func) in _PARAMETER and value.args:
        value = value.args[0].value
    final = None
    node = value
    while isinstance(node, cst.Call):
        t = cast_target(names, node)
        if final is None and t is not None:
            final = t
        if isinstance(node.func, cst.Attribute) and node.func.attr.value in _TENSOR_CHAIN:
            node = node.func.value
            continue
        if final is None:
            final = dtype_kwarg(names, node)
        break
    return final == "float16"


def _direct_tensor_names(params: cst.BaseExpression) -> list[str]:
    """Names passed as parameters: ``latents``, ``[a, b]``, ``[{"params": [a]}]``."""
    out: list[str] = []
    stack: list[cst.CSTNode] = [params]
    while stack:
        n = stack.pop()
        if isinstance(n, cst.Name):
            out.append(n.value)
        elif isinstance(n, (cst.List, cst.Tuple)):
            stack.extend(e.value for e in n.elements)
        elif isinstance(n, cst.Dict):
            for e in n.elements:
                if isinstance(e, cst.DictElement) and h.string_value(e.key) == "params":
                    stack.append(e.value)
    return out


class Fp16ModelRule(Rule):
    """Base for rules that need to know which models were made float16: feeds an Fp16ModelTracker
    (``self.t``) from the shared traversal. Not a rule itself (it has no code)."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.t = Fp16ModelTracker(ctx)

    def visit_Name(self, node: cst.Name) -> None:
        self.t.visit_Name(node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.t.visit_Attribute(node)

    def visit_Call(self, node: cst.Call) -> None:
        self.t.visit_Call(node)

    def leave_Assign(self, node: cst.Assign) -> None:
        self.t.leave_Assign(node)
