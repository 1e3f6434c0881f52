from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import scaler as sf
from ampdoctor.lint.semantic import source
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.semantic.facts import facts_of


def _arms(node: cst.If) -> list[cst.BaseSuite]:
    """The bodies of an if/elif/else chain."""
    out: list[cst.BaseSuite] = [node.body]
    rest = node.orelse
    while isinstance(rest, cst.If):
        out.append(rest.body)
        rest = rest.orelse
    if isinstance(rest, cst.Else):
        out.append(rest.body)
    return out


class ClipSkippedUnderAmp(Rule):
    """The float32 branch of a training step clips the gradients and the AMP branch does not."""

    code = "AMP114"
    name = "clip-skipped-under-amp"
    severity = Severity.WARNING
    message = ("Gradients are clipped only when AMP is off: the AMP branch steps with `{step}` and no "
               "clipping, while the other branch clips with `{clip}`, so every mixed-precision run trains "
               "unclipped. Call `{s}.unscale_({opt})`, then the same clipping, before `{step}`.")
    fix_availability = "suggestion"
    words = (b"clip_grad",)
    also = (b"scaler", b"Scaler")
    summary = "The float32 branch clips gradients and the GradScaler branch steps without clipping."

    def _clips(self, call: cst.Call, depth: int = 0) -> bool:
        """``call`` clips gradients, itself or through a function of this file it runs."""
        if sf.clips_gradients(self.ctx.names, call):
            return True
        fn = facts_of(self.ctx).calls.callee(call)
        return fn is not None and depth < 2 and any(
            isinstance(n, cst.Call) and self._clips(n, depth + 1) for n in h.walk(fn.node.body))

    def visit_If(self, node: cst.If) -> None:
        names = self.ctx.names
        scaled: list[tuple[cst.Call, str, str]] = []  # per arm without clipping: its scaler step
        clip: cst.Call | None = None
        for arm in _arms(node):
            calls = [n for n in h.walk(arm) if isinstance(n, cst.Call)]
            clipping = next((c for c in calls if self._clips(c)), None)
            step = next((c for c in calls if (mc := h.method_call(c, "step")) is not None
                         and voc.is_scaler(names, mc[0]) and c.args), None)
            plain = any((mc := h.method_call(c, "step")) is not None and voc.is_optimizer(names, mc[0])
                        for c in calls)
            if step is not None and clipping is None:
                recv = step.func.value  # type: ignore[attr-defined]
                scaled.append((step, source.short(recv, 30), source.short(step.args[0].value, 30)))
            elif clipping is not None and step is None and plain:
                clip = clip or clipping
        if clip is None:
            return
        for step, s, opt in scaled:
            self.report(step, self.message.format(step=source.short(step, 40), clip=source.short(clip.func, 40),
                                                  s=s, opt=opt))
