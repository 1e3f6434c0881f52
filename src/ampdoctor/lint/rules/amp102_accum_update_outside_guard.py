from __future__ import annotations


from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic.scaler import ScalerFlow, exclusive, short


class AccumUpdateOutsideGuard(ScalerFlow):
    """With gradient accumulation, ``S.update()``/``S.unscale_()`` must sit under the guard of ``S.step()``."""

    code = "AMP102"
    name = "accum-update-outside-guard"
    severity = Severity.ERROR
    message = ("`{s}.update()` runs on every micro-batch but `{s}.step()` does not: the step runs only "
               "when `{g}`, and on the micro-batches without a step it raises \"No inf checks were recorded prior to update\". "
               "Call it under the same condition, right after the step.")
    unscale_message = ("`{s}.unscale_({o})` runs on every micro-batch but `{s}.step()` does not: the step "
                       "runs only when `{g}`, so the unscale raises \"unscale_() has already been called\" on the next micro-batch, or mixes "
                       "unscaled and scaled gradients. Call it under the same condition, just before the step.")
    fix_title = "Move the call under the accumulation guard of `step()`"
    fix_availability = "suggestion"
    words = (b"caler.step(", b"GradScaler")
    summary = "Gradient accumulation: `GradScaler.update()`/`unscale_()` outside the `if` that guards `step()`."

    def decide(self) -> None:
        for u in self.events:
            if u.kind not in ("update", "unscale") or u.loop is None:
                continue
            if any(c.accumulation and c.in_loop for c in u.conds):
                continue  # the call is itself under an accumulation-like guard
            steps = [e for e in self.in_region(u, "step") if e.scaler == u.scaler and e.loop == u.loop]
            if not steps:
                continue
            steps = [st for st in steps if not exclusive(st, u)]  # the other arm of an accumulation switch
            if not steps:
                continue
            guarded = []
            for st in steps:
                guards = [c for c in st.conds if c.accumulation and c.in_loop]
                if not guards:
                    break  # some step of this scaler runs on every iteration
                if any(c.other_branch_exits() for c in guards):
                    break  # `if boundary: step() else: continue`: what follows runs only after a step
                if exclusive(st, u):
                    break
                guarded.append(guards[-1])
            else:
                g = guarded[0]
                if u.kind == "update":
                    msg = self.message.format(s=u.scaler, g=g.text)
                else:
                    msg = self.unscale_message.format(s=u.scaler, o=short(u.arg), g=g.text)
                self.report(u.node, msg)
