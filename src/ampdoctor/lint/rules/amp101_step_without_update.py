from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.rule import FixSpec
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.semantic.scaler import Event, ScalerFlow, exclusive, reaches


class StepWithoutUpdate(ScalerFlow):
    """``scaler.step(opt)`` must be followed by ``scaler.update()`` in the same iteration."""

    code = "AMP101"
    name = "step-without-update"
    severity = Severity.ERROR
    message = ("`{s}.step()` has no `{s}.update()` after it in the same iteration: the loss scale never "
               "adapts, and a second step raises. Call `{s}.update()` once after the optimizer steps.")
    twice_message = ("`{s}.step({o})` is called again before `{s}.update()`: this raises "
                     "\"step() has already been called since the last update()\". Call `{s}.update()` "
                     "after each round of optimizer steps.")
    fix_title = "Insert `{s}.update()` after the step"
    move_title = "Move `{s}.update()` to right after the step"
    fix_availability = "unsafe"
    words = (b"scaler", b"Scaler")
    summary = "`GradScaler.step()` without `GradScaler.update()` in the same iteration."

    _built: bool | None = None

    def decide(self) -> None:
        protocol = [e for e in self.events if e.kind in ("step", "update")]
        updated = {e.scaler for e in protocol if e.kind == "update"}
        for e in protocol:
            if e.kind != "step":
                continue
            rnd = e.extra["round"]
            # the events of the same scaler in the same round of steps (a training iteration)
            same = [o for o in protocol if o.scaler == e.scaler and o.region == e.region
                    and (rnd == o.region or o.inside(rnd))]
            later = [o for o in same if o.order > e.order and not exclusive(o, e)]
            nxt = next((o for o in later if o.kind == "update" or o.arg == e.arg), None)
            if nxt is not None and nxt.kind == "update":
                continue
            if nxt is not None:  # the same optimizer steps again first
                self._flag(e, self.twice_message.format(s=e.scaler, o=e.arg))
                continue
            if rnd != e.region:
                if any(o.kind == "update" for o in same):
                    continue  # update earlier in the loop body, for the previous step
            elif e.scaler in updated:
                continue  # the update lives in another function (a split step/update protocol)
            if e.scaler not in updated and not self._built_here() and not e.extra.get("data_loop"):
                # the scaler comes from another file, and so does its protocol's update: mmgen's
                # `train_step(..., loss_scaler)` steps in a loop, its runner updates once per iteration
                continue
            # an update later in the function, outside this round (once per epoch): with one more
            # update after the step it would run with no step before it and raise, so the fix moves it
            stale = [o for o in protocol if o.kind == "update" and o.scaler == e.scaler and o not in same
                     and o.order > e.order and reaches(e, o)]
            # `self.scaler` never updated in this file: a training script may drive the protocol
            # (`trainer.scaler.update()` after `trainer.gen_update(...)`), which the project pass checks
            attr = e.scaler.rsplit(".", 1)[-1] if e.scaler and "." in e.scaler and e.scaler not in updated \
                and not e.extra.get("data_loop") else None
            self._flag(e, self.message.format(s=e.scaler), stale, (f".{attr}.update(",) if attr else ())

    def _built_here(self) -> bool:
        """The file constructs an enabled GradScaler (else a step outside any loop belongs to a
        protocol another file drives: `def step_all(self, grad_scaler): ...` called by a trainer)."""
        if self._built is None:
            self._built = any(f.kind == "scaler" for f in facts_of(self.ctx).evidence.facts)
        return self._built

    def _flag(self, e: Event, message: str, stale: list[Event] = (), completed_by: tuple[str, ...] = ()) -> None:
        fix = None
        if e.statement is not None and len(e.statement[0].body) == 1:  # `a; b` lines would never converge
            line, _block = e.statement
            update = cst.parse_statement(f"{e.scaler}.update()\n")
            changes = [(line, cst.FlattenSentinel([line, update]))]
            title = self.fix_title.format(s=e.scaler)
            if stale:
                old = stale[0]
                movable = (len(stale) == 1 and old.statement is not None and not old.conds
                           and len(old.statement[0].body) == 1 and _siblings(old.statement[1]) > 1)
                if not movable:  # a conditional or shared update: no mechanical fix keeps it valid
                    self.report(e.node, message, None, completed_by=completed_by)
                    return
                changes.append((old.statement[0], cst.RemovalSentinel.REMOVE))
                title = self.move_title.format(s=e.scaler)
            fix = FixSpec(tuple(changes), safe=False, title=title)
        self.report(e.node, message, fix, completed_by=completed_by)


def _siblings(block) -> int:
    """How many statements the block holds (removing the only one would leave it empty)."""
    body = getattr(block, "body", ())
    return len(body) if isinstance(body, (list, tuple)) else 1
