from __future__ import annotations

import math

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic.config import scaler_arg, scaler_target
from ampdoctor.lint.semantic import vocabulary as voc

DEFAULT_SCALE = 2.0 ** 16
# clean steps after which a scaler that starts low still has not reached the default scale
SLOW_STEPS = 20_000
_SUBNORMAL = 6e-8  # the smallest positive float16


class TinyInitScale(Rule):
    """``GradScaler(init_scale=2.0)`` whose scale needs tens of thousands of steps to grow."""

    code = "AMP112"
    name = "tiny-init-scale"
    severity = Severity.WARNING
    message = ("`init_scale={init}` takes {steps:,} clean steps to reach the default loss scale: growing "
               "{growth}x every {interval} steps, it needs {doublings} growths to reach 65536, and until then float16 gradients below "
               "about {floor} (not {default_floor}) underflow to 0. Start at the default (2**16) and let the scaler back off, or use "
               "a short `growth_interval`.")
    fix_availability = "suggestion"
    words = (b"init_scale",)
    summary = "A `GradScaler` whose small `init_scale` and long `growth_interval` keep the scale low for many steps."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.found: list[tuple[cst.Call, str, str | None]] = []  # (call, message, the name bound to it)
        self.manual: set[str] = set()  # scalers the code sets the scale of itself: `scaler.update(new_scale)`

    def leave_Module(self, node: cst.Module) -> None:
        for call, message, name in self.found:
            if name is None or name not in self.manual:
                self.report(call, message)

    def visit_Call(self, node: cst.Call) -> None:
        mc = h.method_call(node, "update")
        if mc is not None and node.args and voc.is_scaler(self.ctx.names, mc[0]):
            self.manual.add(dotted_name(mc[0]) or "")
            return
        q = self.ctx.names.qualified(node.func) or ""
        if not voc.is_grad_scaler_name(q) or h.has_star_args(node) or voc.in_test(self.ctx):
            return  # tests pick a small scale on purpose (to see it grow, to compare states)
        names = self.ctx.names
        enabled = scaler_arg(names, node, "enabled")
        if isinstance(enabled, cst.Name) and enabled.value == "False":
            return
        init = h.number_value(scaler_arg(names, node, "init_scale"))
        if init is None or init <= 0 or init >= DEFAULT_SCALE:
            return
        growth = h.number_value(scaler_arg(names, node, "growth_factor"))
        growth = 2.0 if growth is None else growth
        interval = h.number_value(scaler_arg(names, node, "growth_interval"))
        interval = 2000 if interval is None else interval
        if growth <= 1 or interval <= 0:
            return
        doublings = math.ceil(math.log(DEFAULT_SCALE / init) / math.log(growth))
        steps = int(doublings * interval)
        if steps <= SLOW_STEPS:
            return
        name = scaler_target(self.ctx)
        self.found.append((node, self.message.format(init=f"{init:g}", interval=int(interval), growth=f"{growth:g}",
                                              doublings=doublings, steps=steps, floor=f"{_SUBNORMAL / init:.0e}",
                                              default_floor=f"{_SUBNORMAL / DEFAULT_SCALE:.0e}"), name))
