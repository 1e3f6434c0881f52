from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.rule import FixSpec
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.semantic.scaler import ScalerFlow, code_of, exclusive, reaches, short, strip_parens


class PlainBackwardWithScaler(ScalerFlow):
    """``loss.backward()`` without ``S.scale()`` on the path to ``S.step(opt)``."""

    code = "AMP105"
    name = "plain-backward-with-scaler"
    severity = Severity.ERROR
    message = ("`{r}.backward()` is not scaled, yet `{s}.step({o})` unscales its gradients: it divides them by "
               "the loss scale (or fails when no scale was set yet). Use `{s}.scale({l}).backward()`.")
    fix_title = "Scale the loss: `{s}.scale({l}).backward()`"
    fix_availability = "unsafe"
    words = (b"caler.step(", b"GradScaler")
    summary = "An unscaled `loss.backward()` whose gradients are stepped by `GradScaler.step()`."

    def _unscaled_by_callers(self, p) -> bool:
        """Some in-file caller passes a loss that is visibly not scaled (``self._backward(loss * w)``);
        a plain name may have been scaled before the call, so it does not count."""
        info = facts_of(self.ctx).calls.function(p.extra["parameter"])
        if info is None:
            return False
        for site in info.sites:
            args = [a.value for a in site.call.args if a.keyword is None]
            if args and not isinstance(strip_parens(args[0]), cst.Name) and "scale" not in code_of(args[0]):
                return True
        return False

    def decide(self) -> None:
        for p in self.events:
            if p.kind != "plain_bw":
                continue
            if any(c.amp for c in p.conds):
                continue  # `if not use_amp: loss.backward()`: the author picks the backward per mode
            if p.extra.get("parameter") and not self._unscaled_by_callers(p):
                continue  # `def _backward(self, loss)`: the caller passes `self.scaler.scale(loss)`
            region = [e for e in self.events if e.region == p.region]
            if any(e.kind in ("scale_bw", "maybe_bw") and exclusive(e, p) for e in region):
                continue  # `if amp: S.scale(l).backward() else: l.backward()`: a deliberate switch
            later = [e for e in region if e.order > p.order and reaches(p, e)]
            q = next((e for e in later if e.kind == "step"), None)
            if q is None:
                continue
            if any(e.kind == "update" and e.scaler == q.scaler or e.kind == "zero_grad"
                   for e in later if e.order < q.order):
                continue  # the gradients are cleared first (a backward for input gradients, as in FGSM)
            scaler_opts = {e.arg for e in region if e.kind in ("step", "unscale")}
            if any(e.kind == "plain_step" and e.arg not in scaler_opts for e in later):
                continue  # these gradients feed another, unscaled optimizer
            recv = p.extra["receiver"]
            text = short(code_of(strip_parens(recv)))
            fix = None
            if set(q.branches) <= set(p.branches):
                new_recv = cst.parse_expression(f"{q.scaler}.scale(x)")
                new_recv = new_recv.with_changes(args=[cst.Arg(strip_parens(recv))])
                fix = FixSpec(((recv, new_recv),), safe=False, title=self.fix_title.format(s=q.scaler, l=text))
            self.report(p.node, self.message.format(r=short(p.arg), l=text, s=q.scaler, o=short(q.arg)), fix)
