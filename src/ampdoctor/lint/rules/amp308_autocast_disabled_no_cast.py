from __future__ import annotations

import libcst as cst
from ampdoctor.lint import tree as _tree

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic import source
from ampdoctor.lint import helpers as h
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import autocast as acs

# calls whose result autocast lowers to float16/bfloat16 (on CUDA and on CPU)
_PRODUCERS = {f"torch.nn.functional.{n}" for n in (
    "linear", "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "scaled_dot_product_attention")}
_PRODUCERS |= {f"torch.{n}" for n in ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
                                      "conv1d", "conv2d", "conv3d")}
_PRODUCER_METHODS = ("matmul", "mm", "bmm")
_LOW_MODULES = {f"torch.nn.{n}" for n in (
    "Linear", "LazyLinear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
    "ConvTranspose3d", "LazyConv1d", "LazyConv2d", "LazyConv3d")}
# calls that compute with a tensor argument (and so run in its dtype, or fail on a mix)
_TORCH_COMPUTE = {f"torch.{n}" for n in (
    "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "softmax", "log_softmax", "exp", "log", "sum",
    "mean", "var", "std", "norm", "cumsum", "logsumexp", "sigmoid", "tanh", "pow", "sqrt", "rsqrt",
    "cdist", "var_mean", "std_mean", "prod", "cumprod", "erf", "erfinv")}
_COMPUTE_PREFIXES = ("torch.nn.functional.", "torch.linalg.", "torch.fft.", "torch.special.")
_COMPUTE_METHODS = ("matmul", "mm", "bmm", "softmax", "log_softmax", "exp", "log", "sum", "mean", "var", "std",
                    "norm", "pow", "sqrt", "rsqrt", "cumsum", "logsumexp", "prod", "cumprod")
_FUNCTIONAL_NOT_COMPUTE = {"torch.nn.functional.pad", "torch.nn.functional.dropout"}


class AutocastDisabledNoCast(Rule):
    """``autocast(enabled=False)`` nested in autocast, fed tensors of the outer region without a cast."""

    code = "AMP308"
    name = "autocast-disabled-no-cast"
    severity = Severity.WARNING
    message = ("{dtype} `{name}` reaches `{op}` inside `autocast(enabled=False)` without a cast: it comes "
               "from `{src}` under autocast, so the op runs in {dtype}, or raises on a dtype "
               "mismatch with float32 weights. Cast it first: `{name}.float()`.")
    fix_availability = "suggestion"
    words = (b"enabled=False", b"enabled = False", b"autocast(False")
    summary = "Tensors from an autocast region used in a nested `autocast(enabled=False)` without a cast."

    def visit_With(self, node: cst.With) -> None:
        if not any((ac := acs.autocast_call(self.ctx.names, i.item)) is not None and ac.enabled is False
                   for i in node.items):
            return
        outer = acs.active_region(self.ctx)
        if outer is None or outer.ac.dtype in ("float32", "float64"):
            return
        dtype = outer.ac.effective_dtype or "float16/bfloat16"
        tracked = self._outer_values(outer.body, node)
        if not tracked:
            return
        self._check_inner(node.body, tracked, dtype)

    # -- what the outer region computed ---------------------------------------------------
    def _low(self, value: cst.BaseExpression) -> str | None:
        """A short description of ``value`` when autocast lowers it, else None."""
        if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.MatrixMultiply):
            return source.short(value, 30)
        if not isinstance(value, cst.Call):
            return None
        q = self.ctx.names.qualified(value.func)
        if q in _PRODUCERS:
            return source.short(value.func) + "(...)"
        if h.method_call(value, *_PRODUCER_METHODS) is not None and \
                self.ctx.names.qualified(value.func.value) != "torch":  # type: ignore[attr-defined]
            return source.short(value.func) + "(...)"
        if isinstance(value.func, (cst.Name, cst.Attribute)) and self.ctx.names.made_by(value.func) in _LOW_MODULES:
            return source.short(value.func) + "(...)"
        return None

    def _outer_values(self, body: cst.CSTNode, stop: cst.CSTNode) -> dict[str, str]:
        """Names whose every binding before ``stop`` in the outer region is a lowered result."""
        low: dict[str, str] = {}
        other: set[str] = set()
        done = False

        def bind(target: cst.CSTNode, src: str | None) -> None:
            for n in [target] if isinstance(target, cst.Name) else list(h.walk(target, enter_scopes=True)):
                if isinstance(n, cst.Name):
                    if src is not None and n is target and n.value not in other:
                        low[n.value] = src
                    else:
                        other.add(n.value)
                        low.pop(n.value, None)

        def visit(n: cst.CSTNode) -> None:
            nonlocal done
            if done:
                return
            if n is stop:
                done = True
                return
            if isinstance(n, h.SCOPES):
                return
            if isinstance(n, cst.Assign):
                src = self._low(n.value)
                for t in n.targets:
                    bind(t.target, src)
            elif isinstance(n, (cst.AugAssign, cst.AnnAssign)):
                bind(n.target, None)
            elif isinstance(n, cst.For):
                bind(n.target, None)
            elif isinstance(n, cst.AsName):
                bind(n.name, None)
            elif isinstance(n, cst.NamedExpr):
                bind(n.target, None)
            for c in _tree.children(n):
                visit(c)

        visit(body)
        return low

    # -- the disabled region ------------------------------------------------------------------
    def _check_inner(self, body: cst.CSTNode, tracked: dict[str, str], dtype: str) -> None:
        live = dict(tracked)
        reported: set[str] = set()

        def use(n: cst.CSTNode, op: str) -> None:
            if isinstance(n, cst.Name) and n.value in live and n.value not in reported:
                reported.add(n.value)
                self.report(n, self.message.format(name=n.value, src=live[n.value], op=op, dtype=dtype))

        def visit(n: cst.CSTNode) -> None:
            if isinstance(n, h.SCOPES):
                return
            if isinstance(n, cst.With) and any(acs.autocast_call(self.ctx.names, i.item) is not None for i in n.items):
                return  # autocast re-entered (or disabled again): its own rules apply
            if isinstance(n, cst.Call):
                op = self._compute_call(n)
                if op is not None:
                    for a in n.args:
                        if not a.star:
                            use(a.value, op)
                mc = h.method_call(n, *_COMPUTE_METHODS)
                if mc is not None:
                    use(mc[0], f".{mc[1]}()")
            elif isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.MatrixMultiply):
                use(n.left, "@")
                use(n.right, "@")
            for c in _tree.children(n):
                visit(c)
            # a name rebound inside the disabled region is no longer the outer value
            if isinstance(n, cst.Assign):
                for t in n.targets:
                    for m in [t.target, *h.walk(t.target, enter_scopes=True)]:
                        if isinstance(m, cst.Name):
                            live.pop(m.value, None)
            elif isinstance(n, (cst.AugAssign, cst.AnnAssign, cst.For)):
                for m in [n.target, *h.walk(n.target, enter_scopes=True)]:
                    if isinstance(m, cst.Name):
                        live.pop(m.value, None)

        visit(body)

    def _compute_call(self, call: cst.Call) -> str | None:
        names = self.ctx.names
        q = names.qualified(call.func)
        if q is not None and q not in _FUNCTIONAL_NOT_COMPUTE and \
                (q in _TORCH_COMPUTE or q.startswith(_COMPUTE_PREFIXES)):
            return source.short(call.func)
        if isinstance(call.func, (cst.Name, cst.Attribute)):
            made = names.made_by(call.func)
            if made is not None and made.startswith("torch.nn.") and made[len("torch.nn."):][:1].isupper():
                return source.short(call.func)
        return None
