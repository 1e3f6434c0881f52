from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import models as nu
from ampdoctor.lint.semantic import source
from ampdoctor.lint.rule import FixSpec

SAFE_EPS = "1e-4"


class AdamEpsFp16(nu.Fp16ModelRule):
    """Adam-family optimizer with an eps that is 0 in float16, over float16 parameters."""

    code = "AMP205"
    name = "adam-eps-fp16"
    severity = Severity.ERROR
    message = ("`{opt}` uses eps={eps}{default}, which is 0 in float16, on float16 parameters: {why}, "
               "so the denominator `sqrt(v) + eps` is 0 wherever a gradient is zero or tiny, so those weights become inf/NaN. "
               "Train float32 parameters under autocast, or at least pass `eps={safe}`.")
    fix_title = "Set `eps={safe}`"
    fix_availability = "unsafe"
    words = (b".half", b"float16", b"HalfTensor")
    also = (b"Adam", b"RMSprop", b"Adagrad")
    summary = "Adam/AdamW/RMSprop/Adagrad eps below float16's smallest value on float16 parameters."

    def leave_Module(self, node: cst.Module) -> None:
        if self.t.master_weights:
            return
        why: dict[int, str] = {}
        for conv, opt, target in self.t.fp16_matches():
            why.setdefault(id(opt.node), f"`{target}` was made float16 by `{source.short(conv.node, 30)}`")
        for opt in self.t.optimizers:
            if id(opt.node) not in why and opt.fp16_tensors:
                why[id(opt.node)] = f"`{opt.fp16_tensors[0]}` is a float16 tensor"
            if id(opt.node) not in why:
                s = self.t.default_fp16_before(opt)
                if s is not None and opt.receivers:
                    why[id(opt.node)] = "the default dtype was set to float16 before the model was built"
            if id(opt.node) in why:
                self._check(opt, why[id(opt.node)])

    def _check(self, opt: nu.OptimizerCall, why: str) -> None:
        name = nu.torch_optimizer_name(opt.qualified)
        if name not in nu.TORCH_OPTIMIZER_EPS:
            return
        call = opt.node
        if h.has_star_args(call):
            return
        fused = h.arg(call, None, "fused")
        if isinstance(fused, cst.Name) and fused.value == "True":
            return  # the fused kernels do their arithmetic in float32
        eps_expr = h.arg(call, nu.TORCH_OPTIMIZER_EPS_POS[name], "eps")
        if eps_expr is None:
            eps, default = nu.TORCH_OPTIMIZER_EPS[name], " (the default)"
        else:
            eps, default = h.number_value(eps_expr), ""
        if not nu.is_tiny(eps):
            return
        new_value = cst.Float(SAFE_EPS)
        if eps_expr is not None:
            change = (eps_expr, new_value)
        else:
            args = list(call.args)
            last = args[-1]
            trailing = last.comma
            args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(cst.Arg(value=new_value, keyword=cst.Name("eps"),
                                equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                      whitespace_after=cst.SimpleWhitespace("")),
                                comma=trailing))
            change = (call, call.with_changes(args=args))
        fix = FixSpec((change,), safe=False, title=self.fix_title.format(safe=SAFE_EPS))
        self.report(call, self.message.format(opt=name, eps=nu.fmt_number(eps), default=default, why=why,
                                              safe=SAFE_EPS), fix)
