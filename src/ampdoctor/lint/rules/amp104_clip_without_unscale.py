from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.rule import FixSpec
from ampdoctor.lint.semantic.scaler import Event, ScalerFlow, exclusive, insertion_point, reaches, short


class ClipWithoutUnscale(ScalerFlow):
    """Gradient clipping (or a magnitude read of ``p.grad``) between ``S.scale(loss).backward()``
    and ``S.step(opt)`` without ``S.unscale_(opt)`` first."""

    code = "AMP104"
    name = "clip-without-unscale"
    severity = Severity.ERROR
    message = ("`{f}` runs on gradients still multiplied by the loss scale: there is no `{s}.unscale_({o})` "
               "before it, so the threshold is effectively divided by the scale. Call `{s}.unscale_({o})` "
               "before clipping.")
    read_message = ("`{f}` reads gradients still multiplied by the loss scale: there is no `{s}.unscale_({o})` "
                    "before it. Call `{s}.unscale_({o})` first.")
    fix_title = "Insert `{s}.unscale_({o})` before the statement"
    fix_availability = "unsafe"
    words = (b"caler.step(", b"GradScaler")
    summary = "Gradient clipping or a gradient-norm read on scaled gradients, before `GradScaler.unscale_()`."

    def decide(self) -> None:
        fixed_windows: list[tuple[Event, tuple]] = []
        unscaled_scalers = {e.scaler for e in self.events if e.kind == "unscale"}
        for c in self.events:
            if c.kind != "clip":
                continue
            after = [q for q in self.in_region(c, "step", "update") if q.order > c.order and reaches(c, q)]
            q = next((e for e in after if e.kind == "step"), None)
            if q is None:
                continue
            if next((e for e in after if e.kind == "update"), q).order < q.order:
                continue  # an update comes first: the step belongs to a later round
            if any(cc.amp and not any(cq.if_id == cc.if_id or (cq.key, cq.truth) == (cc.key, cc.truth)
                                      for cq in q.conds) for cc in c.conds):
                continue  # `if not use_amp: clip(...)` around a scaler that is then disabled
            before = [e for e in self.events if e.region == c.region and e.order < c.order]
            bws = [b for b in before if b.kind == "scale_bw" and reaches(b, c)]
            if bws:
                b = bws[-1]
                between = [e for e in before if e.order > b.order]
            else:
                # the backward lives elsewhere (a `backward()` method): only when the scaler is
                # never unscaled anywhere in the file and this function has no backward at all
                if q.scaler in unscaled_scalers or self.in_region(c, "scale_bw", "maybe_bw", "plain_bw"):
                    continue
                b = None
                between = before
            if any(e.kind in ("unscale", "unscale_any", "step", "update") and not exclusive(e, c)
                   for e in between):
                continue
            template = self.read_message if c.extra.get("tensor_read") else self.message
            fix = self._fix(c, q, after, b, fixed_windows)
            self.report(c.node, template.format(f=c.arg, s=q.scaler, o=short(q.arg)), fix)

    def _fix(self, c: Event, q: Event, after: list[Event], b: Event | None, fixed_windows) -> FixSpec | None:
        point = insertion_point(c, q)  # before `for p in params:`, not once per parameter
        if point is None:
            return None
        target, branches = point
        if not set(q.branches) <= set(branches):
            return None  # the step is conditional (`if amp:`) but the clip is not
        upd = next((e for e in after if e.kind == "update" and e.order > q.order), None)
        opts = {e.arg for e in after if e.kind == "step" and (upd is None or e.order < upd.order)}
        if len(opts) != 1:
            return None  # several optimizers: which one owns the clipped parameters is unknown
        window = (b.order if b is not None else None, q.order)
        for other, w in fixed_windows:
            if w == window and not exclusive(other, c):
                return None  # one unscale_ per step: a second one would raise
        fixed_windows.append((c, window))
        try:
            new = cst.parse_statement(f"{q.scaler}.unscale_({q.arg})\n")
        except cst.ParserSyntaxError:
            return None
        new = new.with_changes(leading_lines=target.leading_lines)
        title = self.fix_title.format(s=q.scaler, o=q.arg)
        return FixSpec(((target, cst.FlattenSentinel([new, target.with_changes(leading_lines=())])),),
                       safe=False, title=title)
