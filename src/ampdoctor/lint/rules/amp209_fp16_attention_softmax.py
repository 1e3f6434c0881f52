from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import values as mu
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.semantic.flow import FunctionFlow, flow_of
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import autocast as acs

_CODE = cst.Module([])
_FUSED = {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "memory_efficient_attention",
          "flex_attention"}


@dataclass
class _Softmax:
    call: cst.Call
    inp: cst.BaseExpression
    autocast: acs.Autocast | None  # the innermost autocast region around it, when enabled
    scopes: tuple = ()  # the defs and classes around it


@dataclass
class _Finding:
    sm: _Softmax
    region: str | None  # source of the float16 autocast call around it, else None
    device: str | None = None


class Fp16AttentionSoftmax(Rule):
    """Hand-written attention (``softmax(q @ kᵀ) @ v``) computed in float16 with no precision decision."""

    code = "AMP209"
    name = "fp16-attention-softmax"
    severity = Severity.WARNING
    message = ("Hand-written attention in a file that uses float16: the scores `q @ kᵀ` are materialised in "
               "float16 with no float32 upcast, so large logits overflow to inf and the softmax row turns into "
               "NaN. Use `F.scaled_dot_product_attention(q, k, v)`, whose fused kernels keep the logits in float32.")
    region_message = ("`{region}` does not make this hand-written attention precise: it runs both matmuls in "
                      "float16 ({softmax}), so `q @ kᵀ` can overflow to inf before the softmax. Use "
                      "`F.scaled_dot_product_attention(q, k, v)`, or compute the scores in float32 with autocast "
                      "disabled.")
    fix_availability = "suggestion"
    words = (b"softmax",)
    also = (b"float16", b".half", b"autocast", b"fp16", b"GradScaler")
    summary = "Hand-written `softmax(q @ kᵀ) @ v` attention computed in float16 without a float32 upcast."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.softmaxes: dict[int, list[_Softmax]] = {}
        self.findings: list[_Finding] = []

    def visit_Call(self, node: cst.Call) -> None:
        inp = mu.softmax_input(self.ctx.names, node)
        if inp is None:
            return
        fn = h.enclosing_scope(self.ctx)
        if not isinstance(fn, cst.FunctionDef):
            return
        regions = acs.enclosing_autocasts(self.ctx)
        ac = regions[0] if regions and regions[0].enabled is not False else None
        scopes = tuple(p for p in self.ctx.parents if isinstance(p, (cst.FunctionDef, cst.ClassDef)))
        self.softmaxes.setdefault(id(fn), []).append(_Softmax(node, inp, ac, scopes))

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        sms = self.softmaxes.pop(id(node), None)
        if not sms or self._precision_tested(node):
            return
        flow = flow_of(self.ctx, node)
        for sm in sms:
            if any(a.keyword is not None and a.keyword.value == "dtype" for a in sm.call.args):
                continue  # softmax(..., dtype=torch.float32): a deliberate precision choice
            chain = self._scores_chain(sm, flow)
            if chain is None or any(mu.contains_upcast(self.ctx.names, e) for e in chain):
                continue
            if not self._feeds_matmul(sm, flow):
                continue
            ac = sm.autocast
            if ac is not None:
                dtype = ac.effective_dtype
                if dtype is None and ac.dtype_expr is not None and \
                        h.mentions_dtype(self.ctx.names, ac.dtype_expr, "float16"):
                    dtype = "float16"
                if dtype == "float16":
                    self.findings.append(_Finding(sm, _CODE.code_for_node(ac.call).strip(), ac.device))
                    continue
                if dtype is not None:
                    continue  # bfloat16 (float32's range) or float32
            self.findings.append(_Finding(sm, None))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.findings or self._uses_sdpa(node):
            return
        evidence = facts_of(self.ctx).evidence
        for f in self.findings:
            if f.region is not None:
                text = f.region if len(f.region) <= 40 else f.region.split("(", 1)[0] + "(...)"
                softmax = "and on CPU the softmax as well" if f.device == "cpu" else \
                    "only the softmax is kept in float32 on CUDA"
                self.report(f.sm.call, self.region_message.format(region=f"with {text}", softmax=softmax))
                continue
            if evidence.fp16_near(list(f.sm.scopes)) is not None:
                self.report(f.sm.call)

    def _precision_tested(self, fn: cst.FunctionDef) -> bool:
        """The function branches on the precision (`if x.dtype == torch.float16:`): its author
        handled 16-bit inputs deliberately."""
        for n in h.walk(fn.body):
            if isinstance(n, (cst.If, cst.IfExp)):
                test = n.test
                if any(h.dtype_of(self.ctx.names, m) is not None for m in [test, *h.walk(test)]
                       if isinstance(m, (cst.Attribute, cst.Name))):
                    return True
                if any(w in ("fp16", "half", "autocast") or "fp16" in w for w in h.names_in(test)):
                    return True
        return False

    def _uses_sdpa(self, module: cst.Module) -> bool:
        """The file uses a fused attention kernel (calls it, or hands it to a benchmark helper):
        its hand-written attention is a deliberate fallback or reference (timm's `fused_attn`
        switch, flash-attention's eager baseline, a pattern for a compiler pass)."""
        for n in h.walk(module, enter_scopes=True):
            t = type(n)
            if t is cst.Name:
                last = n.value
            elif t is cst.Attribute:
                last = n.attr.value
            else:
                continue
            if last in _FUSED or last.startswith(("scaled_dot_product", "flash_attn")):
                return True
        return False

    # -- data flow -----------------------------------------------------------------------
    def _scores_chain(self, sm: _Softmax, flow: FunctionFlow) -> list[cst.CSTNode] | None:
        """The expressions the softmax input is computed from, back to a matmul (``q @ kᵀ``) in
        this function, with that matmul's operands and their bindings; None without a matmul."""
        names = self.ctx.names
        chain: list[cst.CSTNode] = []
        found = False
        seen: set[tuple[str, int]] = set()
        todo = [(sm.inp, flow.pos(sm.call), 0)]
        while todo:
            expr, at, depth = todo.pop()
            chain.append(expr)
            for n in [expr, *h.walk(expr)]:
                ops = mu.matmul_operands(names, n)
                if ops is not None:
                    if _scaled_in_gemm(names, n) or self._bounded(ops, flow, at):
                        return None  # the logits cannot get near the float16 range
                    found = True
                    for op in ops:  # q and k: were they upcast before the matmul?
                        for name in mu.expr_names(op):
                            b = flow.binding_at(name, at)
                            if b is not None and b.value is not None:
                                chain.append(b.value)
            if depth >= 5:
                continue
            for name in mu.expr_names(expr):
                b = flow.binding_at(name, at)
                if b is not None and b.value is not None and (name, b.start) not in seen:
                    seen.add((name, b.start))
                    todo.append((b.value, b.start, depth + 1))
        return chain if found else None

    def _bounded(self, ops: list[cst.BaseExpression], flow: FunctionFlow, at: int) -> bool:
        """``q @ kᵀ`` whose result is already the (small) logit: both operands are unit vectors
        (cosine attention, ``F.normalize``), or one is scaled by 1/sqrt(d) before the product
        (``q = q * self.scale``): what is materialised is the final logit, not a raw dot product."""
        kinds = []
        for op in ops:
            exprs = [op]
            # back through the operand's own earlier values: `q = q * self.scale` then
            # `q = rotary(q)` (a rotation, a reshape) still multiplies the scaled query
            todo, seen = [(name, at) for name in mu.expr_names(op)], set()
            while todo and len(seen) < 12:
                name, pos = todo.pop()
                b = flow.binding_at(name, pos)
                if b is None or b.value is None or (name, b.start) in seen:
                    continue
                seen.add((name, b.start))
                exprs.append(b.value)
                if name in mu.expr_names(b.value):
                    todo.append((name, b.start))
            kinds.append({k for e in exprs for k in _operand_kinds(self.ctx.names, e)})
        if all("unit" in k for k in kinds):
            return True
        return any("scaled" in k for k in kinds)

    def _feeds_matmul(self, sm: _Softmax, flow: FunctionFlow) -> bool:
        """The probabilities reach a matmul with the values: directly (``softmax(s) @ v``) or
        through names bound in this function (dropout, reshapes)."""
        names = self.ctx.names
        for p in flow.ancestors(sm.call):
            if mu.matmul_operands(names, p) is not None:
                return True  # `softmax(s) @ v` in one expression
            if isinstance(p, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                break
        start, tainted = flow.derived(sm.call)
        if not tainted:
            return False
        for n in flow.nodes[start + 1:]:
            ops = mu.matmul_operands(names, n)
            if ops is not None and any(tainted & mu.expr_names(op) for op in ops):
                return True
        return False


_NORMALIZERS = ("normalize", "l2norm", "l2_norm", "unit", "cosine")
# normalisation layers (QK-norm): the operand's RMS is its weight's, far from the float16 range
_NORM_LAYERS = ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "q_norm", "k_norm", "qk_norm", "norm_q",
                "norm_k", "q_ln", "k_ln", "ln_q", "ln_k", "lnq", "lnk")
_SCALES = ("scale", "scaling", "temperature", "temp", "sqrt", "rsqrt", "inv_sqrt", "norm_factor", "softmax_scale")


def _scaled_in_gemm(names, node: cst.CSTNode) -> bool:
    """`torch.baddbmm(out, q, k, beta=0, alpha=softmax_scale)`: the 1/sqrt(d) factor is applied
    inside the GEMM, so what is stored is the final logit, not the raw dot product."""
    if not isinstance(node, cst.Call) or not (names.qualified(node.func) or "").endswith("baddbmm"):
        return False
    alpha = h.arg(node, 4, "alpha")
    return alpha is not None and h.number_value(alpha) != 1.0


def _operand_kinds(names, expr: cst.CSTNode) -> set[str]:
    """"unit" for a normalised vector (``F.normalize(q)``, ``q / q.norm(...)``), "scaled" for one
    multiplied or divided by a 1/sqrt(d)-style factor (``q * self.scale``, ``q / math.sqrt(d)``,
    ``q * d ** -0.5``), looking through transposes and reshapes."""
    out: set[str] = set()
    for n in [expr, *h.walk(expr)]:
        if isinstance(n, cst.Call):
            last = (names.qualified(n.func) or "").rsplit(".", 1)[-1].lower()
            if any(w in last for w in _NORMALIZERS) or any(w in last for w in _NORM_LAYERS):
                out.add("unit")
        elif isinstance(n, cst.BinaryOperation) and isinstance(n.operator, (cst.Multiply, cst.Divide)):
            for side in (n.left, n.right):
                words = list(h.names_in(side))
                if isinstance(n.operator, cst.Divide) and side is n.right and "norm" in words:
                    out.add("unit")
                if any(any(w in word for w in _SCALES) for word in words) and not any("mask" in w for w in words):
                    out.add("scaled")
                if isinstance(side, cst.BinaryOperation) and isinstance(side.operator, cst.Power) and \
                        (h.number_value(side.right) or 0) < 0:
                    out.add("scaled")  # d ** -0.5
    return out
