from __future__ import annotations

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic.scaler import ScalerFlow, reaches, short


class UnscaleTwice(ScalerFlow):
    """``S.unscale_(opt)`` twice, or after ``S.step(opt)``, before ``S.update()``."""

    code = "AMP103"
    name = "unscale-twice"
    severity = Severity.ERROR
    message = ("`{s}.unscale_({o})` is called again before `{s}.update()`: this raises \"unscale_() has "
               "already been called on this optimizer since the last update()\". Unscale each optimizer "
               "once per step, before clipping.")
    after_step_message = ("`{s}.unscale_({o})` comes after `{s}.step({o})` and before `{s}.update()`: this "
                          "raises \"unscale_() is being called after step()\". Unscale before the step; "
                          "`step()` already unscales the gradients itself.")
    words = (b"unscale_(",)
    summary = "`GradScaler.unscale_()` twice for one optimizer (or after `step()`) before `update()`."

    def decide(self) -> None:
        for u in self.events:
            if u.kind != "unscale":
                continue
            prev = None
            for e in self.in_region(u, "unscale", "step", "update"):
                if e.order >= u.order or e.scaler != u.scaler:
                    continue
                if e.kind != "update" and e.arg != u.arg:
                    continue
                if reaches(e, u):
                    prev = e  # the latest one wins: events are in source order
            if prev is None or prev.kind == "update":
                continue
            msg = self.message if prev.kind == "unscale" else self.after_step_message
            self.report(u.node, msg.format(s=u.scaler, o=short(u.arg)))
