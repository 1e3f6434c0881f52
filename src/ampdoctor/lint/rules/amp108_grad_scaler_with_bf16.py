from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import config as u
from ampdoctor.lint.rule import FixSpec, Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic import branches
from ampdoctor.lint.semantic import casts as conv
from ampdoctor.lint.semantic import vocabulary as voc


@dataclass
class _Scaler:
    call: cst.Call
    enabled: cst.BaseExpression | None
    bf16_enabled: bool  # `enabled=` is true because the run is bf16
    conditional: bool  # created under a branch about the precision
    bf16_param: str | None = None  # the function building it accepts a bf16 precision


class GradScalerWithBf16(Rule):
    """A GradScaler that is active for bfloat16 runs."""

    code = "AMP108"
    name = "grad-scaler-with-bf16"
    severity = Severity.WARNING
    message = ("This GradScaler is enabled for bfloat16 too (`enabled={e}`): bf16 has fp32's exponent "
               "range and needs no loss scaling, so it only adds an unscale and an inf check to every "
               "step and can skip steps. Enable it for float16 only.")
    all_bf16_message = ("This GradScaler is always enabled, yet every autocast region in this file runs in "
                        "bfloat16: bf16 needs no loss scaling, and the scaler adds an unscale and an inf check "
                        "to every step and can skip steps. Drop it, or create it with `enabled=False` for bf16.")
    param_message = ("This GradScaler is always enabled, although this code accepts bfloat16 (`{p}`): "
                     "for bf16 it adds an unscale and an inf check to every step and can skip steps. "
                     "Create it with `enabled=` true for float16 only.")
    fix_title = "Enable the GradScaler for float16 only"
    fix_availability = "safe"
    words = (b"GradScaler",)
    summary = "A `GradScaler` that is enabled for bfloat16 autocast, which needs no loss scaling."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.scalers: list[_Scaler] = []
        self.autocasts: list[acs.Autocast] = []

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        ac = acs.autocast_call(names, node)
        if ac is not None:
            if ac.enabled is not False:
                self.autocasts.append(ac)
            return
        if not u.is_grad_scaler_ctor(names, node) or h.has_star_args(node):
            return
        enabled = u.scaler_enabled(names, node)
        self.scalers.append(_Scaler(
            node, enabled,
            enabled is not None and u.enables_for_bf16(names, enabled),
            u.in_precision_branch(self.ctx), self._bf16_parameter()))

    def _bf16_parameter(self) -> str | None:
        """``precision="bf16"`` (or a dtype parameter the function turns into bfloat16) among the
        parameters of the function that builds the scaler: that code is meant to run bf16 too."""
        fn = next((p for p in self.ctx.ancestors() if isinstance(p, cst.FunctionDef)), None)
        if fn is None:
            return None
        names = self.ctx.names
        for p in (*fn.params.params, *fn.params.kwonly_params):
            words = voc.words(p.name.value)
            if not ({"precision", "dtype", "amp", "mixed"} & set(words)):
                continue
            if p.default is not None and "bfloat16" in conv.possible_dtypes(names, p.default):
                return f"{p.name.value}={u.short(p.default, 20)}"
            for n in h.walk(fn.body):
                if isinstance(n, cst.Comparison) and p.name.value in h.names_in(n) and branches.selects_bf16(names, n):
                    return p.name.value
        return None

    def leave_Module(self, node: cst.Module) -> None:
        acs = self.autocasts
        # a region that computes in fp16 (explicitly or by default) or an unknown dtype
        fp16_possible = any(ac.effective_dtype != "bfloat16" for ac in acs)
        implicit = any(ac.dtype_expr is None and ac.device != "cpu" for ac in acs)
        all_bf16 = bool(acs) and not fp16_possible
        for s in self.scalers:
            if s.bf16_enabled:
                fix = None
                # disabling the scaler for bf16 is only right when autocast really runs bf16
                # then: a CUDA autocast without dtype runs fp16 whatever the config says
                if acs and not implicit:
                    new = u.fp16_only_rewrite(self.ctx.names, s.enabled)
                    if new is not None:
                        fix = FixSpec(((s.enabled, new),), safe=True, title=self.fix_title)
                self.report(s.call, self.message.format(e=u.short(s.enabled)), fix)
            elif s.bf16_param is not None and not s.conditional and \
                    (s.enabled is None or u.is_literal(s.enabled, True)):
                self.report(s.call, self.param_message.format(p=s.bf16_param))
            elif all_bf16 and not s.conditional and (s.enabled is None or u.is_literal(s.enabled, True)):
                self.report(s.call, self.all_bf16_message)
