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
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.names import dotted_name


# words of an `enabled=` expression that make it follow the dtype (`args.fp16`, `dtype == ...`)
_DTYPE_WORDS = ("16", "half", "dtype", "bf", "fp", "float")


@dataclass
class _Scaler:
    call: cst.Call
    enabled: cst.BaseExpression | None
    bf16_enabled: bool  # `enabled=` is true because the run is bf16
    conditional: bool  # created under a branch about the precision
    bf16_param: str | None = None  # the function building it accepts a bf16 precision
    setting: cst.BaseExpression | None = None  # what the file assigns to `enabled=self.amp` (one value)
    key: tuple = ()  # (the def or class it lives in, the name it is bound to)
    wrapper: bool = False  # a wrapper that owns a GradScaler (timm's NativeScaler): called, not `.scale()`d

    @property
    def where(self) -> str:
        """Where it lives: ``self.scaler`` in a class, else in a function."""
        return "class" if self.key[1].startswith(("self.", "cls.")) else "function"


class GradScalerWithBf16(Rule):
    """A GradScaler that is active for bfloat16 runs."""

    code = "AMP108"
    name = "grad-scaler-with-bf16"
    severity = Severity.WARNING
    message = ("This GradScaler is enabled for bfloat16 too (`enabled={e}`): {via}bf16 has fp32's exponent "
               "range and needs no loss scaling, so it only adds an unscale and an inf check to every "
               "step and can skip steps. Enable it for float16 only.")
    all_bf16_message = ("This GradScaler is always enabled, yet every autocast region in this file runs in "
                        "bfloat16: bf16 needs no loss scaling, and the scaler adds an unscale and an inf check "
                        "to every step and can skip steps. Drop it, or create it with `enabled=False` for bf16.")
    flag_message = ("This GradScaler is enabled by the bfloat16 switch (`enabled={e}`): bf16 has fp32's "
                    "exponent range and needs no loss scaling, so it only adds an unscale and an inf check to "
                    "every step and can skip steps. Enable it for float16 only.")
    switch_message = ("This GradScaler is on whenever AMP is, bfloat16 included: {e}, and the autocast's "
                      "`dtype={d}` can be bfloat16. bf16 has fp32's exponent range and needs no loss "
                      "scaling, so the scaler only adds an unscale and an inf check to every step and can skip "
                      "steps. Enable it for float16 only.")
    switch_all_bf16_message = ("This GradScaler is on whenever AMP is, and this {where}'s AMP is bfloat16: "
                               "{e}, and every autocast region of this {where} "
                               "runs in bfloat16, which needs no loss scaling. The scaler only adds an unscale and an "
                               "inf check to every step and can skip steps. Drop it, or enable it for float16 only.")
    param_message = ("This GradScaler is always enabled, although this code accepts bfloat16 (`{p}`): "
                     "for bf16 it adds an unscale and an inf check to every step and can skip steps. "
                     "Create it with `enabled=` true for float16 only.")
    fix_title = "Enable the GradScaler for float16 only"
    fix_availability = "safe"
    words = (b"GradScaler", b"NativeScaler")
    summary = "A `GradScaler` that is enabled for bfloat16 autocast, which needs no loss scaling."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.scalers: list[_Scaler] = []
        self.autocasts: list[acs.Autocast] = []
        self.places: dict[int, set[int]] = {}  # id(autocast call) -> ids of the def and class around it
        self.guarded: set[tuple] = set()  # scalers whose `S.scale(loss)` sits in a branch about the precision
        self.used: set[tuple] = set()  # ... and those that scale a loss outside such a branch
        self.calls: set[tuple] = set()  # names called or passed to a call, outside such a branch
        self.guarded_calls: set[tuple] = set()  # ... and inside one

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        ac = acs.autocast_call(names, node)
        if ac is not None:
            if ac.enabled is not False:
                self.autocasts.append(ac)
                self.places[id(node)] = {id(p) for p in self.ctx.ancestors() if isinstance(p, (cst.FunctionDef, cst.ClassDef))}
            return
        scaled = voc.scaled_by(names, node)
        if scaled is not None:
            (self.guarded if u.in_precision_branch(self.ctx) else self.used).add(self._key(scaled))
            return
        # names called or passed on: a scaler wrapper (timm's NativeScaler) scales when called, or
        # in the loop it is handed to
        for part in (node.func, *(a.value for a in node.args)):
            if isinstance(part, (cst.Name, cst.Attribute)):
                (self.guarded_calls if u.in_precision_branch(self.ctx) else self.calls).add(
                    self._key(dotted_name(part) or ""))
        if voc.is_scaler_wrapper_name(names.qualified(node.func)) and not u.in_precision_branch(self.ctx):
            # always on: it takes no `enabled`
            self.scalers.append(_Scaler(node, None, False, False, None, None,
                                        self._key(u.scaler_target(self.ctx) or "loss_scaler"), wrapper=True))
            return
        if not u.is_grad_scaler_ctor(names, node) or h.has_star_args(node):
            return
        enabled = u.scaler_enabled(names, node)
        # `enabled=self.use_amp` with `self.use_amp = precision != "fp32"` elsewhere in the file
        values = facts_of(self.ctx).assigned_values(dotted_name(enabled) or "") if enabled is not None else []
        setting = values[0] if len(values) == 1 else None
        bf16 = enabled is not None and (u.enables_for_bf16(names, enabled) or
                                        setting is not None and u.enables_for_bf16(names, setting))
        self.scalers.append(_Scaler(node, enabled, bf16, u.in_precision_branch(self.ctx),
                                    self._bf16_parameter(), setting, self._key(u.scaler_target(self.ctx) or "scaler")))

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
        facts = facts_of(self.ctx)
        for s in self.scalers:
            # an autocast where the scaler lives (its def, or its class for `self.scaler`) whose
            # dtype is a choice that includes bfloat16 (`dtype=AMP_DTYPE[cfg.amp_dtype]`)
            here = [ac for ac in acs if s.key[0] in self.places.get(id(ac.call), ())]
            choice = next((ac for ac in here if ac.dtype_expr is not None and
                           "bfloat16" in conv.selectable_dtypes(self.ctx.names, ac.dtype_expr, facts)), None)
            if s.bf16_enabled:
                fix = None
                # disabling the scaler for bf16 is only right when autocast really runs bf16
                # then: a CUDA autocast without dtype runs fp16 whatever the config says
                if acs and not implicit:
                    new = u.fp16_only_rewrite(self.ctx.names, s.enabled)
                    if new is not None:
                        fix = FixSpec(((s.enabled, new),), safe=True, title=self.fix_title)
                if voc.is_bf16_flag(s.enabled):
                    self.report(s.call, self.flag_message.format(e=u.short(s.enabled)), fix)
                else:
                    via = "" if s.setting is None or u.enables_for_bf16(self.ctx.names, s.enabled) else \
                        f"`{u.short(s.enabled, 40)}` is `{u.short(s.setting, 40)}`. "
                    self.report(s.call, self.message.format(e=u.short(s.enabled), via=via), fix)
            elif s.bf16_param is not None and not s.conditional and \
                    (s.enabled is None or u.is_literal(s.enabled, True)):
                self.report(s.call, self.param_message.format(p=s.bf16_param))
            elif all_bf16 and not s.conditional and (s.enabled is None or u.is_literal(s.enabled, True)):
                self.report(s.call, self.all_bf16_message)
            elif choice is not None and self._switch(s) and not s.conditional and self._in_use(s):
                # on with mixed precision whatever its dtype, and the dtype can be bfloat16
                e = f"`enabled={u.short(s.enabled)}` does not look at the dtype" if s.enabled else \
                    "it is always enabled, whatever the dtype"
                if all(ac.effective_dtype == "bfloat16" for ac in here):
                    self.report(s.call, self.switch_all_bf16_message.format(e=e, where=s.where))
                else:
                    self.report(s.call, self.switch_message.format(e=e, d=u.short(choice.dtype_expr, 40)))

    def _in_use(self, s: _Scaler) -> bool:
        """The scaler scales a loss outside any branch about the precision: `S.scale(loss)`, or,
        for a wrapper, a call of it or a hand-off to the training loop."""
        if s.wrapper:
            return s.key in self.calls and s.key not in self.guarded_calls
        return s.key in self.used and s.key not in self.guarded

    def _key(self, name: str) -> tuple:
        """A scaler name with where it lives: the class for ``self.scaler``, else the def."""
        kinds = (cst.ClassDef,) if name.startswith(("self.", "cls.")) else (cst.FunctionDef,)
        owner = next((p for p in self.ctx.ancestors() if isinstance(p, kinds)), None)
        return id(owner), name

    def _switch(self, s: _Scaler) -> bool:
        """``enabled=`` turns mixed precision on or off without looking at the dtype
        (``cfg.enable_amp``, ``amp and grad_scaling``; absent): the scaler is on for every
        autocast dtype."""
        if s.enabled is None:
            return True
        if u.is_literal(s.enabled, False):
            return False
        return not any(u.test_mentions(self.ctx.names, e, _DTYPE_WORDS) for e in (s.enabled, s.setting) if e is not None)
