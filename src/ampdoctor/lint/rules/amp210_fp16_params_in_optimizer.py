from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic import models as nu
from ampdoctor.lint.semantic import source


class Fp16ParamsInOptimizer(nu.Fp16ModelRule):
    """A model converted to float16 whose parameters an optimizer then trains (no master weights)."""

    code = "AMP210"
    name = "fp16-params-in-optimizer"
    severity = Severity.ERROR
    message = ("`{opt}` trains float16 parameters with no float32 master copy: `{conv}` made them float16, so "
               "updates smaller than 1/2048 of a weight round away{scaler}. Keep the model in float32 and "
               "run the forward pass under `torch.autocast` (with a GradScaler for float16).")
    words = (b".half", b"float16", b"from_pretrained")
    also = (b"optim", b"GradScaler", b"Adam", b"SGD")
    summary = ("Model converted with `.half()`/`.to(torch.float16)` or loaded with `torch_dtype=torch.float16`, "
               "then trained by an optimizer.")

    def leave_Module(self, node: cst.Module) -> None:
        done: set[int] = set()
        for conv, opt, target in self.t.fp16_matches():
            if id(conv.node) in done:
                continue
            done.add(id(conv.node))
            scaler = " and GradScaler raises \"Attempting to unscale FP16 gradients\"" if self.t.scaler else ""
            self.report(conv.node, self.message.format(conv=source.short(conv.node, 40), opt=opt.qualified.rsplit(".", 1)[-1],
                                                       scaler=scaler))
