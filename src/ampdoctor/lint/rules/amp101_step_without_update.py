from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import FixSpec, Rule
from ampdoctor.lint.semantic import vocabulary as voc


@dataclass
class _Event:
    kind: str  # "step" or "update"
    scaler: str
    optimizer: str | None
    node: cst.Call
    region: cst.CSTNode  # innermost loop, else function, else module
    regions: tuple[int, ...]  # ids of every loop/function/module around the call
    branches: tuple
    order: int
    statement: tuple | None


def _loop_names(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value.lower()}
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(*(_loop_names(e.value) for e in target.elements))
    return set()


class StepWithoutUpdate(Rule):
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
    fix_availability = "unsafe"
    words = (b"scaler", b"Scaler")
    summary = "`GradScaler.step()` without `GradScaler.update()` in the same iteration."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.events: list[_Event] = []

    def visit_Call(self, node: cst.Call) -> None:
        mc = h.method_call(node, "step", "update")
        if mc is None:
            return
        recv, meth = mc
        if not voc.is_scaler(self.ctx.names, recv):
            return
        scaler = dotted_name(recv)
        if scaler is None:
            return
        opt = None
        if meth == "step":
            if not node.args:
                return
            opt = cst.Module([]).code_for_node(node.args[0].value)
        region = None
        regions = []
        stepped = set(h.names_in(node.args[0].value)) if meth == "step" else set()
        for p in self.ctx.ancestors():
            if isinstance(p, (h.LOOPS + h.SCOPES + (cst.Module,))):
                regions.append(id(p))
                if region is None and not (isinstance(p, cst.For) and stepped & _loop_names(p.target)):
                    region = p  # `for opt in optimizers: scaler.step(opt)` is one round of steps
        self.events.append(_Event(meth, scaler, opt, node, region, tuple(regions),
                                  h.branch_path(self.ctx), len(self.events), h.statement_of(self.ctx)))

    def leave_Module(self, node: cst.Module) -> None:
        updates_anywhere = {e.scaler for e in self.events if e.kind == "update"}
        for e in self.events:
            if e.kind != "step":
                continue
            region_id = id(e.region)
            same = [o for o in self.events if o.scaler == e.scaler and region_id in o.regions]
            later = [o for o in same if o.order > e.order and not h.exclusive(o.branches, e.branches)]
            nxt = next((o for o in later if o.kind == "update" or o.optimizer == e.optimizer), None)
            if nxt is not None and nxt.kind == "update":
                continue
            if nxt is not None:  # the same optimizer steps again first
                self._flag(e, self.twice_message.format(s=e.scaler, o=e.optimizer))
                continue
            if isinstance(e.region, h.LOOPS):
                if any(o.kind == "update" for o in same):
                    continue  # update earlier in the loop body, for the previous step
            elif e.scaler in updates_anywhere:
                continue  # the update lives in another function (a split step/update protocol)
            self._flag(e, self.message.format(s=e.scaler))

    def _flag(self, e: _Event, message: str) -> None:
        fix = None
        if e.statement is not None and len(e.statement[0].body) == 1:  # `a; b` lines would never converge
            line, _block = e.statement
            update = cst.parse_statement(f"{e.scaler}.update()\n")
            fix = FixSpec(((line, cst.FlattenSentinel([line, update])),), safe=False,
                          title=self.fix_title.format(s=e.scaler))
        self.report(e.node, message, fix)
