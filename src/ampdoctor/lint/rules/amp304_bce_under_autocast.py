from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic import source
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import autocast as acs

_BCE_FUNCS = {"torch.nn.functional.binary_cross_entropy", "torch._C._nn.binary_cross_entropy"}
_BCE_CLASSES = {"torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss", "torch.nn.modules.BCELoss"}


class BceUnderAutocast(Rule):
    """``F.binary_cross_entropy`` / ``nn.BCELoss`` called inside a CUDA autocast region."""

    code = "AMP304"
    name = "bce-under-autocast"
    severity = Severity.ERROR
    in_tests = True  # a bug whatever the test intends
    message = ("`{call}` inside a CUDA autocast region raises RuntimeError{when}: CUDA autocast bans "
               "binary_cross_entropy because float16 probabilities are unsafe.{via} Compute it on "
               "logits with `F.binary_cross_entropy_with_logits` or `nn.BCEWithLogitsLoss` (dropping the "
               "sigmoid), or call it outside the autocast region on `.float()` inputs.")
    fix_availability = "suggestion"
    words = (b"binary_cross_entropy", b"BCELoss")
    summary = "`binary_cross_entropy`/`BCELoss` inside CUDA autocast, which raises."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        # per def (module level first): local names bound so far -> whether to a BCELoss
        self.scopes: list[dict[str, bool]] = [{}]

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scopes.append({p.name.value: False for p in (*node.params.posonly_params, *node.params.params,
                                                           *node.params.kwonly_params)})

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def leave_Assign(self, node: cst.Assign) -> None:
        is_bce = isinstance(node.value, cst.Call) and self.ctx.names.qualified(node.value.func) in _BCE_CLASSES
        for t in node.targets:
            if isinstance(t.target, cst.Name):
                self.scopes[-1][t.target.value] = is_bce

    def leave_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None and isinstance(node.target, cst.Name):
            self.scopes[-1][node.target.value] = isinstance(node.value, cst.Call) and \
                self.ctx.names.qualified(node.value.func) in _BCE_CLASSES

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        func = node.func
        q = names.qualified(func)
        hit = q in _BCE_FUNCS
        if not hit and isinstance(func, cst.Call):
            hit = names.qualified(func.func) in _BCE_CLASSES  # nn.BCELoss()(p, y)
        if not hit and isinstance(func, cst.Name):
            hit = self.scopes[-1].get(func.value, False)  # criterion = nn.BCELoss(); criterion(p, y)
        if not hit and isinstance(func, cst.Attribute):
            hit = names.made_by(func) in _BCE_CLASSES  # self.criterion = nn.BCELoss() in __init__
        if not hit:
            return
        region = acs.active_region(self.ctx, inherited=True)
        if region is None or region.ac.device not in ("cuda", None):
            return
        when = "" if region.ac.device == "cuda" else " when it runs on CUDA"
        via = ""
        if region.via is not None:  # the enclosing function is only called inside autocast
            via = f" This function runs in the autocast region around `{source.short(region.via, 40)}`."
        self.report(node, self.message.format(call=source.short(func, 45) + "(...)", when=when, via=via))
