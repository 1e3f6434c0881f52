from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.semantic.facts import facts_of


def _opens_autocast(names, fn: cst.FunctionDef) -> acs.Autocast | None:
    for d in fn.decorators:
        ac = acs.autocast_call(names, d.decorator)
        if ac is not None and ac.enabled is not False:
            return ac
    for n in h.walk(fn.body):
        if isinstance(n, cst.With):
            for item in n.items:
                ac = acs.autocast_call(names, item.item)
                if ac is not None and ac.enabled is not False:
                    return ac
    return None


def _scales_loss(names, fn: cst.FunctionDef) -> bool:
    return any(voc.scaled_by(names, n) is not None for n in h.walk(fn.body))


def _calls_super(fn: cst.FunctionDef) -> bool:
    for n in h.walk(fn.body):
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and isinstance(n.func.value, cst.Call) \
                and isinstance(n.func.value.func, cst.Name) and n.func.value.func.value == "super":
            return True
    return False


class OverrideDropsAutocast(Rule):
    """A subclass overrides a training-step method and loses the base class's autocast."""

    code = "AMP310"
    name = "override-drops-autocast"
    severity = Severity.WARNING
    message = ("`{cls}.{m}` drops the autocast of the `{base}.{m}` it overrides: the base runs its forward "
               "pass under `{ac}`, but the override opens no autocast region and still scales the loss, so this subclass trains in "
               "float32 while paying for loss scaling, and its numerics differ from the base class's. Wrap the "
               "forward pass in the same autocast, or call `super().{m}(...)`.")
    fix_availability = "suggestion"
    words = (b"autocast",)
    also = (b"scale(",)
    summary = "A subclass's training-step override that drops the base class's autocast region."

    def leave_Module(self, node: cst.Module) -> None:
        calls = facts_of(self.ctx).calls
        names = calls.names
        for fn in list(calls.functions.values()):
            if fn.cls is None:
                continue
            base = calls.base_method(fn)
            if base is None:
                continue
            ac = _opens_autocast(names, base.node)
            if ac is None or _opens_autocast(names, fn.node) is not None or _calls_super(fn.node):
                continue
            if not _scales_loss(names, fn.node):
                continue  # an fp32 path on purpose: no loss scaling either
            if calls.inherited_region(fn.node) is not None:
                continue  # every caller runs it under autocast
            text = " ".join(cst.Module([]).code_for_node(ac.call).split())
            text = text if len(text) <= 40 else text.split("(", 1)[0] + "(...)"
            self.report(fn.node.name, self.message.format(cls=fn.cls.name, m=fn.name, base=base.qualname.split(".")[0],
                                                          ac=text))
