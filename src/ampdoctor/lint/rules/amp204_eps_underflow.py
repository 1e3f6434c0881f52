from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import models as nu
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.semantic import casts as conv
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.semantic.flow import FunctionFlow, flow_of
from ampdoctor.lint.semantic import source
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import autocast as acs

# ops that CUDA autocast runs in float32 (aten/src/ATen/autocast_mode.h, AT_FORALL_FP32*): a
# statistic built from them is float32 under autocast, so only pure-float16 code is at risk
_AUTOCAST_FP32 = {"pow", "norm", "vector_norm", "matrix_norm", "sum", "cumsum", "prod", "rsqrt", "exp", "log",
                  "softmax", "log_softmax", "logsumexp", "frobenius_norm", "cdist", "dist", "reciprocal"}
_STAT_METHODS = {"std", "norm", "sqrt"}
_STAT_FUNCS = {"torch.std", "torch.norm", "torch.linalg.norm", "torch.linalg.vector_norm", "torch.sqrt",
               "torch.Tensor.std", "torch.Tensor.norm"}
_NORMALIZE = {"torch.nn.functional.normalize": (3, 1e-12, 1), "torch.nn.functional.cosine_similarity": (3, 1e-8, 2),
              "torch.cosine_similarity": (3, 1e-8, 2)}
# the calls _scan looks at, by their last name (a cheap test during the walk)
_SCANNED_CALLS = {"rsqrt", "div", "div_", "true_divide", "normalize", "cosine_similarity"}
_NOT_TORCH = {"numpy", "np", "scipy", "librosa", "soundfile", "cv2", "pandas", "jax", "math", "statistics"}
_FINFO_TINY = {("float32", "tiny"): 2.0 ** -126, ("float32", "smallest_normal"): 2.0 ** -126,
               ("float64", "tiny"): 2.0 ** -1022, ("float64", "smallest_normal"): 2.0 ** -1022,
               ("float32", "eps"): 2.0 ** -23, ("float64", "eps"): 2.0 ** -52}


@dataclass
class _Candidate:
    node: cst.CSTNode
    eps: cst.BaseExpression | None  # None: a library default (value in default)
    default: float | None
    what: str  # description of the guarded expression
    op: str  # what goes wrong
    pure_only: bool  # safe under autocast: needs a pure-float16 file
    idx: FunctionFlow
    fn: cst.FunctionDef | None
    cls: cst.ClassDef | None


class EpsUnderflow(Rule):
    """A hand-written normalisation whose epsilon is 0 in float16."""

    code = "AMP204"
    name = "eps-underflow"
    severity = Severity.WARNING
    message = ("{eps_text} is 0 in float16, so it guards nothing against {when}: in `{what}` {op}. Compute the "
               "statistic in float32 (`x.float()`, cast the result back) or use eps >= 1e-6.")
    fix_title = "Compute the norm in float32, or raise eps to 1e-6"
    fix_availability = "suggestion"
    # no finding without float16 in the file (a cast, a dtype, or autocast that defaults to it)
    words = (b".half", b"float16", b"autocast")
    also = (b"eps", b"normalize", b"cosine_similarity", b"rsqrt", b"e-")
    summary = "Hand-written norm with an epsilon below float16's smallest value (1e-8, 1e-12) on float16 data."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.autocast = False  # the file runs float16 autocast
        self.trains = False  # the file calls .backward() or builds an optimizer
        self.cands: list[_Candidate] = []
        self._cls_stack: list[cst.ClassDef] = []
        self._dividing: set[int] = set()  # functions (and their enclosing ones) with something _scan looks at

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        if isinstance(node.operator, (cst.Divide, cst.Power)):
            h.mark_enclosing_functions(self.ctx, self._dividing)

    # -- float16 evidence ----------------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        f = node.func
        q = names.qualified(f)
        last = f.attr.value if isinstance(f, cst.Attribute) else f.value if isinstance(f, cst.Name) else ""
        if last in _SCANNED_CALLS or (q or "").rsplit(".", 1)[-1] in _SCANNED_CALLS:
            h.mark_enclosing_functions(self.ctx, self._dividing)
        if not self.trains and (h.method_call(node, "backward") or nu.is_optimizer_class(q)):
            self.trains = True
        ac = acs.autocast_call(names, node)
        if ac is not None:
            if ac.enabled is not False and (
                    ac.effective_dtype == "float16" or ac.dtype_expr is None and ac.device is None
                    or ac.dtype_expr is not None and h.mentions_dtype(names, ac.dtype_expr, "float16")):
                self.autocast = True
            return
    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._cls_stack.append(node)

    def leave_ClassDef(self, node: cst.ClassDef) -> None:
        self._cls_stack.pop()

    # -- candidates ------------------------------------------------------------------------------
    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        if id(node) not in self._dividing:
            return  # no division, power, rsqrt or normalize in it: no candidate, no index to build
        cls = None
        if self._cls_stack and any(b is node for b in self._cls_stack[-1].body.body):
            cls = self._cls_stack[-1]
        self._scan(flow_of(self.ctx, node), node, cls)

    def leave_Module(self, node: cst.Module) -> None:
        self._scan(flow_of(self.ctx, node), None, None)
        if not self.cands:
            return
        evidence = facts_of(self.ctx).evidence
        self.module_consts = self._module_consts(node)
        for c in self.cands:
            # float16 outside autocast: weights made float16, or a float16 switch in the configuration;
            # a stray tensor cast counts only in the candidate's own function or class
            pure = evidence.fp16_for([x for x in (c.cls, c.fn) if x is not None], ("cast", "config")) is not None
            if not (pure or self.autocast):
                continue
            if c.pure_only and (not pure or self.autocast):
                continue  # CUDA autocast computes this statistic in float32
            if c.eps is None and not self.trains:
                continue  # the default eps: only an exact zero vector breaks, flagged in training code only
            value = c.default if c.eps is None else self._eps_value(c, c.eps)
            if value is None or not nu.is_tiny(value):
                continue
            if c.eps is None:
                eps_text = f"The default eps={nu.fmt_number(value)}"
            elif h.number_value(c.eps) is not None:
                eps_text = f"eps={nu.fmt_number(value)}"
            else:
                eps_text = f"`{source.short(c.eps, 30)}` = {nu.fmt_number(value)}"
            text = c.what.replace(" ", "")
            when = "a constant input" if (".std(" in text or ".var(" in text or "torch.std(" in text
                                          or "torch.var(" in text) else "an all-zero input"
            self.report(c.node, self.message.format(eps_text=eps_text, what=c.what, when=when, op=c.op))

    def _scan(self, idx: FunctionFlow, fn: cst.FunctionDef | None, cls: cst.ClassDef | None) -> None:
        names = self.ctx.names
        for n in idx.nodes:
            if isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.Divide):
                self._divisor(idx, fn, cls, n, n.right)
            elif isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.Power) \
                    and h.number_value(n.right) == -0.5:
                self._rsqrt(idx, fn, cls, n, n.left)
            elif isinstance(n, cst.Call):
                q = names.qualified(n.func)
                if q in ("torch.rsqrt", "torch.Tensor.rsqrt") and n.args:
                    self._rsqrt(idx, fn, cls, n, n.args[0].value)
                elif h.method_call(n, "rsqrt") and not n.args and names.qualified(n.func.value) != "torch":  # type: ignore[union-attr]
                    self._rsqrt(idx, fn, cls, n, n.func.value)  # type: ignore[union-attr]
                elif q in ("torch.div", "torch.true_divide") and len(n.args) >= 2:
                    self._divisor(idx, fn, cls, n, n.args[1].value)
                elif h.method_call(n, "div", "div_", "true_divide") and n.args and \
                        names.qualified(n.func.value) != "torch":  # type: ignore[union-attr]
                    self._divisor(idx, fn, cls, n, n.args[0].value)
                elif q in _NORMALIZE:
                    self._normalize(idx, fn, cls, n, q)

    def _add(self, idx, fn, cls, node, eps, what, op, pure_only, default=None) -> None:
        if eps is not None and not self._model_context(idx, fn, cls, node, eps):
            return
        self.cands.append(_Candidate(node, eps, default, what, op, pure_only, idx, fn, cls))

    def _model_context(self, idx: FunctionFlow, fn, cls, node: cst.CSTNode, eps: cst.BaseExpression) -> bool:
        """Model code, where activations are float16: a `forward` (or a method of a class that
        has one), a norm helper (`rms_norm`, `l2norm`, not `normalize_rewards`), an autocast
        block, or an `eps` parameter or attribute. An inline literal in a free function usually
        normalises data (advantages, audio), which stays float32."""
        name = fn.name.value.lower() if fn is not None else ""
        if name.endswith("forward") or "norm" in name and "normaliz" not in name:
            return True
        if cls is not None and any(isinstance(s, cst.FunctionDef) and s.name.value == "forward"
                                   for s in cls.body.body):
            return True
        if isinstance(eps, cst.Attribute) and isinstance(eps.value, cst.Name) and eps.value.value == "self":
            return True
        if isinstance(eps, cst.Name) and nu.param_default(fn, eps.value) not in (False, None):
            return True
        for p in idx.ancestors(node):
            if isinstance(p, cst.With):
                for item in p.items:
                    ac = acs.autocast_call(self.ctx.names, item.item)
                    if ac is not None and ac.enabled is not False and ac.effective_dtype in ("float16", None):
                        return True
        return False

    def _divisor(self, idx, fn, cls, div: cst.CSTNode, right: cst.BaseExpression) -> None:
        right = self._resolve(idx, right, div)
        if right is None:
            return
        g = self._guard(right)
        if g is not None:
            base, eps = g
            stat = self._resolve(idx, base, div)
            if stat is None or not self._is_stat(stat):
                return
            if self._upcast(idx, stat, div, 0):
                return
            if isinstance(stat, cst.Call) and isinstance(stat.func, cst.Attribute) and \
                    self._random_draw(idx, stat.func.value, div):
                return
            self._add(idx, fn, cls, right, eps, source.short(right), "the division gives inf/NaN",
                      self._autocast_fp32(idx, stat, div))
            return
        inner = self._sqrt_of(right)
        if inner is not None:
            g = self._guard(inner)
            if g is None:
                return
            base, eps = g
            if self._upcast(idx, base, div, 0):
                return
            self._add(idx, fn, cls, inner, eps, source.short(inner), "the division gives inf/NaN",
                      self._autocast_fp32(idx, base, div))

    def _rsqrt(self, idx, fn, cls, node: cst.CSTNode, arg: cst.BaseExpression) -> None:
        arg = self._resolve(idx, arg, node) or arg
        g = self._guard(arg)
        if g is None:
            return
        base, eps = g
        if self._upcast(idx, base, node, 0):
            return
        self._add(idx, fn, cls, node, eps, source.short(arg), "rsqrt(0) = inf, and the output becomes NaN",
                  self._autocast_fp32(idx, base, node))

    def _normalize(self, idx, fn, cls, call: cst.Call, q: str) -> None:
        if h.has_star_args(call):
            return
        pos, default, n_inputs = _NORMALIZE[q]
        eps = h.arg(call, pos, "eps")
        inputs = [h.arg(call, 0, "x1"), h.arg(call, 1, "x2")] if n_inputs == 2 else [h.arg(call, 0, "input")]
        if any(i is None for i in inputs) or any(self._upcast(idx, i, call, 0) for i in inputs):
            return
        if all(self._random_draw(idx, i, call) for i in inputs):
            return
        self._add(idx, fn, cls, call, eps, source.short(call), "the result is 0/0 = NaN", True, default)

    # -- shapes --------------------------------------------------------------------------------
    def _resolve(self, idx: FunctionFlow, expr: cst.BaseExpression, at: cst.CSTNode,
                 depth: int = 0) -> cst.BaseExpression | None:
        """A local name -> the value of its single reaching assignment (twice at most)."""
        while isinstance(expr, cst.Name) and depth < 2:
            reaching = idx.reaching(expr.value, at)
            if len(reaching) != 1 or reaching[0].value is None:
                return expr
            at, expr = reaching[0].stmt, reaching[0].value
            depth += 1
        return expr

    def _guard(self, expr: cst.BaseExpression) -> tuple[cst.BaseExpression, cst.BaseExpression] | None:
        """``B + eps``/``eps + B``/``B.add(eps)``/``B.clamp(min=eps)``/``B.clamp_min(eps)`` -> (B, eps)."""
        names = self.ctx.names
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
            if _eps_like(expr.right):
                return expr.left, expr.right
            if _eps_like(expr.left):
                return expr.right, expr.left
            return None
        if isinstance(expr, cst.Call):
            q = names.qualified(expr.func)
            mc = h.method_call(expr, "add", "clamp", "clamp_min", "clip")
            if q in ("torch.clamp", "torch.clip", "torch.clamp_min"):
                base = h.arg(expr, 0, "input")
                eps = h.arg(expr, 1, "min")
            elif q == "torch.add":
                base, eps = h.arg(expr, 0, "input"), h.arg(expr, 1, "other")
            elif mc is not None and names.qualified(mc[0]) != "torch":
                base = mc[0]
                eps = h.arg(expr, 0, "other" if mc[1] == "add" else "min")
            else:
                return None
            if base is not None and eps is not None and _eps_like(eps):
                return base, eps
        return None

    def _sqrt_of(self, expr: cst.BaseExpression) -> cst.BaseExpression | None:
        if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Power) \
                and h.number_value(expr.right) == 0.5:
            return expr.left
        if isinstance(expr, cst.Call):
            if self.ctx.names.qualified(expr.func) in ("torch.sqrt", "torch.Tensor.sqrt") and expr.args:
                return expr.args[0].value
            mc = h.method_call(expr, "sqrt")
            if mc is not None and not expr.args and self.ctx.names.qualified(mc[0]) not in ("torch", "math", "numpy"):
                return mc[0]
        return None

    def _random_draw(self, idx: FunctionFlow, expr: cst.BaseExpression, at: cst.CSTNode) -> bool:
        """``expr`` holds a fresh Gaussian or uniform draw (``torch.randn(d, n).cuda().half()``, a
        memory bank's initial value, through a local name or ``self.x`` assigned here): its norm
        is about sqrt(d), never 0, so the eps never matters."""
        # `x = x / (x.norm() + eps)`: the statement's own assignment is not in effect yet
        at = next((p for p in idx.ancestors(at) if isinstance(p, cst.SimpleStatementLine)), at)
        for _ in range(3):
            d = dotted_name(expr)
            if d is None:
                break
            reaching = idx.reaching(d, at)
            if len(reaching) != 1 or reaching[0].value is None:
                return False
            at, expr = reaching[0].stmt, reaching[0].value
        while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and \
                expr.func.attr.value in _SAME_VALUES:
            expr = expr.func.value
        return isinstance(expr, cst.Call) and self.ctx.names.qualified(expr.func) in _RANDOM_DRAWS

    def _is_stat(self, expr: cst.BaseExpression) -> bool:
        """``x.std(...)``, ``x.norm(...)``, ``torch.linalg.norm(x)``, ``v.sqrt()``, ``torch.sqrt(v)``."""
        if not isinstance(expr, cst.Call):
            return False
        q = self.ctx.names.qualified(expr.func)
        if q in _STAT_FUNCS:
            return True
        mc = h.method_call(expr, *_STAT_METHODS)
        if mc is None:
            return False
        root = self.ctx.names.qualified(mc[0]) or ""
        return root.split(".", 1)[0] not in ("torch", "math", "numpy", "np", "scipy", "jnp", "jax")

    def _upcast(self, idx: FunctionFlow, expr: cst.CSTNode, at: cst.CSTNode, depth: int) -> bool:
        """``expr`` is computed in float32 (or float64), directly or through local names."""
        names = self.ctx.names
        if conv.has_upcast(names, expr) or self._not_torch(expr):
            return True
        if depth >= 4:
            return False
        for n in set(nu.names_in_expr(expr)):
            for a in idx.reaching(n, at):
                if a.value is not None and self._upcast(idx, a.value, a.stmt, depth + 1):
                    return True
        return False

    def _not_torch(self, expr: cst.CSTNode) -> bool:
        """Data that comes from numpy & co (``np.load(...)``, ``t.cpu().numpy()``)."""
        for n in [expr, *h.walk(expr)]:
            if isinstance(n, cst.Call):
                if h.method_call(n, "numpy", "tolist", "item"):
                    return True
                q = self.ctx.names.qualified(n.func) or ""
                if q.split(".", 1)[0] in _NOT_TORCH:
                    return True
        return False

    def _autocast_fp32(self, idx: FunctionFlow, expr: cst.CSTNode, at: cst.CSTNode, depth: int = 0) -> bool:
        """Under CUDA autocast ``expr`` comes out float32 (an op of the fp32 list, no cast back)."""
        names = self.ctx.names
        if conv.has_downcast(names, expr):
            return False
        for n in [expr, *h.walk(expr)]:
            if isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.Power):
                return True
            if isinstance(n, cst.Call):
                q = names.qualified(n.func) or ""
                if q.rsplit(".", 1)[-1] in _AUTOCAST_FP32:
                    return True
        if depth >= 3:
            return False
        for nm in set(nu.names_in_expr(expr)):
            reaching = idx.reaching(nm, at)
            if reaching and all(a.value is not None and self._autocast_fp32(idx, a.value, a.stmt, depth + 1)
                                for a in reaching):
                return True
        return False

    # -- eps values ------------------------------------------------------------------------------
    def _module_consts(self, module: cst.Module) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for stmt in module.body:
            if isinstance(stmt, cst.SimpleStatementLine):
                for s in stmt.body:
                    if isinstance(s, cst.Assign) and len(s.targets) == 1 and isinstance(s.targets[0].target, cst.Name):
                        name = s.targets[0].target.value
                        v = h.number_value(s.value)
                        out[name] = v if name not in out else None
            else:
                for n in h.walk(stmt):
                    if isinstance(n, cst.Assign):
                        for t in n.targets:
                            if isinstance(t.target, cst.Name):
                                out[t.target.value] = None
        return out

    def _eps_value(self, c: _Candidate, expr: cst.BaseExpression, depth: int = 0) -> float | None:
        v = h.number_value(expr)
        if v is not None:
            return v
        if depth > 3:
            return None
        names = self.ctx.names
        if isinstance(expr, cst.Attribute):
            if isinstance(expr.value, cst.Call) and names.qualified(expr.value.func) == "torch.finfo" \
                    and expr.value.args:
                dt = h.dtype_of(names, expr.value.args[0].value)
                return _FINFO_TINY.get((dt or "", expr.attr.value))
            if isinstance(expr.value, cst.Name) and expr.value.value == "self" and c.cls is not None:
                return self._attr_value(c.cls, expr.attr.value)
            return None
        if isinstance(expr, cst.Name):
            reaching = c.idx.reaching(expr.value, c.node)
            if reaching:
                vals = [self._eps_value(c, a.value, depth + 1) if a.value is not None else None for a in reaching]
                return None if any(x is None for x in vals) else min(vals)  # type: ignore[type-var]
            d = nu.param_default(c.fn, expr.value)
            if d is not False:
                if isinstance(d, cst.Name):  # def f(x, eps=EPS)
                    return self.module_consts.get(d.value)
                return h.number_value(d) if d is not None else None  # type: ignore[arg-type]
            if expr.value in c.idx.assigns:
                return None
            return self.module_consts.get(expr.value)
        return None

    def _attr_value(self, cls: cst.ClassDef, attr: str) -> float | None:
        """The value of ``self.<attr>``: every assignment in the class must be a literal, or a
        parameter of that method whose default is one."""
        vals: list[float] = []
        for stmt in cls.body.body:
            if isinstance(stmt, cst.SimpleStatementLine):
                for s in stmt.body:
                    if isinstance(s, (cst.Assign, cst.AnnAssign)):
                        targets = [t.target for t in s.targets] if isinstance(s, cst.Assign) else [s.target]
                        if any(isinstance(t, cst.Name) and t.value == attr for t in targets):
                            v = h.number_value(s.value)
                            if v is None:
                                return None
                            vals.append(v)
            elif isinstance(stmt, cst.FunctionDef):
                for n in h.walk(stmt):
                    targets: list = []
                    value = None
                    if isinstance(n, cst.Assign):
                        targets, value = [t.target for t in n.targets], n.value
                    elif isinstance(n, (cst.AnnAssign, cst.AugAssign)):
                        targets, value = [n.target], getattr(n, "value", None)
                    if not any(dotted_name(t) == "self." + attr for t in targets):
                        continue
                    v = h.number_value(value) if value is not None else None
                    if v is None and isinstance(value, cst.Name):
                        d = nu.param_default(stmt, value.value)
                        v = h.number_value(d) if d not in (None, False) else None  # type: ignore[arg-type]
                    if v is None or isinstance(n, cst.AugAssign):
                        return None
                    vals.append(v)
        return min(vals) if vals else None


_RANDOM_DRAWS = {"torch.randn", "torch.rand", "torch.randn_like", "torch.rand_like", "torch.normal"}
# methods that move or cast a tensor without changing what it holds
_SAME_VALUES = {"cuda", "half", "float", "to", "contiguous", "detach", "clone", "bfloat16", "cpu"}


def _eps_like(expr: cst.BaseExpression) -> bool:
    if h.number_value(expr) is not None:
        return True
    d = dotted_name(expr)
    if d is not None:
        last = d.rsplit(".", 1)[-1].lower()
        return "eps" in last or "epsilon" in last
    if isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Call):
        return expr.attr.value in ("tiny", "smallest_normal", "eps")
    return False
