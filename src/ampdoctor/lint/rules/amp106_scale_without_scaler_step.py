from __future__ import annotations


from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.semantic.scaler import ScalerFlow, code_of, reaches, short

# optimizers whose update is invariant to a constant factor on the gradients (up to eps)
_ADAPTIVE = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam",
             "FusedAdam", "Adafactor", "Lion"}


class ScaleWithoutScalerStep(ScalerFlow):
    """``S.scale(loss).backward()`` followed by a plain ``optimizer.step()``."""

    code = "AMP106"
    name = "scale-without-scaler-step"
    severity = Severity.ERROR
    message = ("`{o}.step()` follows `{s}.scale(...).backward()` without `{s}.step()`: the update uses "
               "gradients still multiplied by the loss scale and inf/NaN steps are not skipped. Call "
               "`{s}.step({o})` and then `{s}.update()` instead.")
    fix_title = "Replace `optimizer.step()` with `scaler.step(optimizer)` followed by `scaler.update()`"
    fix_availability = "suggestion"
    words = (b"caler.scale(", b"GradScaler")
    helper_message = ("`{o}.step()` steps gradients that `{c}(...)` scaled with `{s}.scale()`: its backward "
                      "also reached this optimizer's parameters, and without `{s}.step({o})` the update uses "
                      "gradients still multiplied by the loss scale and inf/NaN steps are not skipped. Pass "
                      "`{o}` to `{c}` and call `{s}.step({o})` there, before `{s}.update()`.")
    summary = "`GradScaler.scale(loss).backward()` followed by a plain `optimizer.step()`."

    def decide(self) -> None:
        for t in self.events:
            if t.kind != "plain_step":
                continue
            if any(c.amp for c in t.conds):
                continue  # `if not use_amp: optimizer.step()`: the plain step of the non-AMP mode
            region = [e for e in self.events if e.region == t.region]
            if any(e.kind in ("step", "unscale", "unscale_any") for e in region):
                continue  # the scaler steps (or unscales) somewhere in this function
            b = next((e for e in reversed(region) if e.kind == "scale_bw" and e.order < t.order
                      and reaches(e, t)), None)
            if b is None:
                self._after_helper(t, region)
                continue
            if any(e.kind == "zero_grad" and b.order < e.order < t.order and reaches(b, e) for e in region):
                continue  # the scaled gradients are cleared before the step
            unit = (b.region, b.scaler) in self.unit_scale or (0, b.scaler) in self.unit_scale
            if unit and not any(e.kind == "update" and e.scaler == b.scaler for e in self.events):
                continue  # GradScaler(1) never updated: the scale stays 1, the gradients are the loss's
            if self._loss_multiplier(t):
                continue
            self.report(t.node, self.message.format(o=short(t.arg), s=b.scaler))

    def _after_helper(self, t, region) -> None:
        """``train(model, optim, x, scaler=scaler)`` runs the scaled backward and steps its own
        optimizer through the scaler; the caller then steps another optimizer (of the same loss:
        latent codes, poses) with a plain ``step()``, on gradients still multiplied by the scale."""
        backward = ("plain_bw", "scale_bw", "maybe_bw")
        for c in reversed([c for c in self.calls if c.region == t.region and c.order <= t.order]):
            if not reaches(c, t):
                continue
            if any(e.kind in backward and c.order <= e.order < t.order for e in region):
                return  # a backward of the caller's own in between: that is the gradient it steps
            inner = [e for e in self.events if e.region == id(c.extra["callee"].node)]
            if not any(e.kind in backward for e in inner):
                continue  # a helper without a backward pass (data, logging)
            b = next((e for e in inner if e.kind == "scale_bw"), None)
            if b is None or not any(e.kind == "step" and e.scaler == b.scaler for e in inner):
                return  # the latest backward is the helper's own plain one, or it leaves the protocol to others
            if any(e.kind == "zero_grad" and e.arg == t.arg and c.order <= e.order < t.order for e in region):
                return  # those gradients are cleared before the step
            call = c.node
            if any(a.value is not None and short(code_of(a.value)) == short(t.arg or "") for a in call.args):
                return  # the optimizer is given to the helper, which may step it itself
            if self._loss_multiplier(t):
                return
            self.report(t.node, self.helper_message.format(o=short(t.arg), c=short(c.arg), s=b.scaler))
            return

    def _loss_multiplier(self, t) -> bool:
        """No float16 anywhere in the file (no autocast, no cast) and an adaptive optimizer:
        the scaler only multiplies the loss (nerfacc scales tiny gradients up on purpose), and
        Adam-style updates do not change with the gradients' scale."""
        ev = facts_of(self.ctx).evidence
        if any(f.kind in ("autocast", "cast", "config") for f in ev.facts):
            return False
        made = (self.ctx.names.assigned.get(t.arg or "") or "").rsplit(".", 1)[-1]
        return made in _ADAPTIVE
