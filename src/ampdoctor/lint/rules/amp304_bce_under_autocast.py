from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import autocast_util as u
from ampdoctor.lint.rule import Rule

_BCE_FUNCS = {"torch.nn.functional.binary_cross_entropy", "torch._C._nn.binary_cross_entropy"}
_BCE_CLASSES = {"torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss", "torch.nn.modules.BCELoss"}


class BceUnderAutocast(Rule):
    """``F.binary_cross_entropy`` / ``nn.BCELoss`` called inside a CUDA autocast region."""

    code = "AMP304"
    name = "bce-under-autocast"
    severity = Severity.ERROR
    message = ("`{call}` inside a CUDA autocast region raises RuntimeError{when}: binary_cross_entropy "
               "is banned under CUDA autocast because float16 probabilities are unsafe. Compute it on "
               "logits with `F.binary_cross_entropy_with_logits` or `nn.BCEWithLogitsLoss` (dropping the "
               "sigmoid), or call it outside the autocast region on `.float()` inputs.")
    fix_availability = "suggestion"
    words = (b"binary_cross_entropy", b"BCELoss")
    summary = "`binary_cross_entropy`/`BCELoss` inside CUDA autocast, which raises."

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        func = node.func
        q = names.qualified(func)
        hit = q in _BCE_FUNCS
        if not hit and isinstance(func, cst.Call):
            hit = names.qualified(func.func) in _BCE_CLASSES  # nn.BCELoss()(p, y)
        if not hit and isinstance(func, (cst.Name, cst.Attribute)):
            hit = names.made_by(func) in _BCE_CLASSES  # criterion = nn.BCELoss(); criterion(p, y)
        if not hit:
            return
        region = u.active_region(self.ctx)
        if region is None or region.ac.device not in ("cuda", None):
            return
        when = "" if region.ac.device == "cuda" else " when it runs on CUDA"
        self.report(node, self.message.format(call=u.short(func, 45) + "(...)", when=when))
