from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic import branches
from ampdoctor.lint.semantic import source
from ampdoctor.lint import helpers as h
from ampdoctor.lint.rule import FixSpec, Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.semantic.facts import facts_of

_LOW = ("float16", "bfloat16")
_WHY = {
    "float16": "values beyond ±65504 turn into inf before autocast sees them, and ops that autocast "
               "keeps in float32 get float16 inputs",
    "bfloat16": "values keep only 8 bits of mantissa before autocast sees them, and ops that autocast "
                "keeps in float32 get bfloat16 inputs",
}


class HalfInsideAutocast(Rule):
    """``.half()`` / ``.bfloat16()`` / ``.to(torch.float16)`` inside an enabled autocast body."""

    code = "AMP303"
    name = "half-inside-autocast"
    severity = Severity.WARNING
    message = ("`{call}` inside an autocast region casts by hand what autocast manages per op: {why}. "
               "Remove the cast and let autocast pick the dtype of each op.")
    fix_title = "Remove the `.{meth}()` cast"
    fix_availability = "unsafe"
    words = (b"autocast",)
    summary = "Manual `.half()`/`.bfloat16()`/`.to(float16)` casts inside an autocast region (opt-in)."
    # mostly redundant in practice: autocast casts the inputs of its float32 ops back up, so the
    # cast costs precision only where a value passes unlisted ops or exceeds the float16 range
    default = False

    def visit_Call(self, node: cst.Call) -> None:
        mc = h.method_call(node, "half", "bfloat16", "to")
        if mc is None:
            return
        recv, meth = mc
        if meth == "to":
            dtype = self._to_dtype(node)
        else:
            dtype = "float16" if meth == "half" else "bfloat16"
            if self.ctx.names.qualified(recv) == "torch":
                return
        if dtype not in _LOW:
            return
        region = acs.active_region(self.ctx)
        if region is not None and voc.in_test(self.ctx):
            return  # a test that feeds float16 inputs to autocast on purpose
        if region is None or branches.under_precision_branch(self.ctx, region.node):
            return  # `if use_pure_fp16: x = x.half()`: a deliberate, mode-dependent cast
        if self._weights_low_precision(region.node):
            return  # the model's weights are 16-bit: inputs cast to match them are needed
        call = source.short(node, 50)
        msg = self.message.format(call=call, why=_WHY[dtype])
        self.report(node, msg, self._fix(node, recv, meth))

    def _weights_low_precision(self, region: cst.CSTNode) -> bool:
        """A model is cast to or loaded in a 16-bit (or configured) dtype at module level or in
        this function, outside the region (a cast inside it is what this rule reports)."""
        models = facts_of(self.ctx).evidence.low_precision_models
        if not models:
            return False
        fn = next((p for p in self.ctx.ancestors() if isinstance(p, cst.FunctionDef)), None)
        here = {0, id(fn)} if fn is not None else {0}
        inside = {id(n) for n in h.walk(region, enter_scopes=True)}
        return any(scope in here and id(call) not in inside for call, scope in models)

    def _to_dtype(self, node: cst.Call) -> str | None:
        cands = [h.arg(node, None, "dtype")]
        positional = [a.value for a in node.args if a.keyword is None and not a.star]
        cands += positional[:2]
        for c in cands:
            if c is None or isinstance(c, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)):
                continue
            d = h.dtype_of(self.ctx.names, c)
            if d is not None:
                return d
        return None

    def _fix(self, node: cst.Call, recv: cst.BaseExpression, meth: str) -> FixSpec | None:
        if meth == "to":
            if len(node.args) != 1 or node.args[0].star:
                return None
        elif node.args:
            return None
        title = self.fix_title.format(meth=meth)
        parent = self.ctx.parents[-2] if len(self.ctx.parents) >= 2 else None
        drop = isinstance(parent, cst.Expr) or (
            isinstance(parent, cst.Assign) and len(parent.targets) == 1
            and source.code(parent.targets[0].target) == source.code(recv))
        if drop:
            # `model.half()` or `x = x.half()` as a statement: the cast is all it does
            st = h.statement_of(self.ctx)
            if st is None:
                return None
            line, block = st
            if len(line.body) != 1 or len(getattr(block, "body", ())) < 2:
                return None
            return FixSpec(((line, cst.RemoveFromParent()),), safe=False, title=title)
        rep = recv
        if node.lpar:
            rep = recv.with_changes(lpar=[*node.lpar, *recv.lpar], rpar=[*recv.rpar, *node.rpar])
        return FixSpec(((node, rep),), safe=False, title=title)
