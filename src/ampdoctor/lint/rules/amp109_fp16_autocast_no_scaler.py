from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.semantic import config as u
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic import branches
from ampdoctor.lint.semantic.facts import facts_of
from ampdoctor.lint.semantic import vocabulary as voc

# identifiers that show the loss is scaled some other way (GradScaler, apex `amp.scale_loss`,
# DeepSpeed/Megatron/fairseq loss scalers) or that a framework owns the backward pass
_SCALING_WORDS = ("scaler", "loss_scale", "scale_loss", "lossscale", "scaled_loss")
# receivers whose `.backward(loss)` is a framework call that scales the loss itself
_FRAMEWORK_BACKWARD = ("accelerator", "engine", "fabric", "deepspeed", "trainer", "strategy", "booster")


class Fp16AutocastNoScaler(Rule):
    """fp16 autocast in a training step with no loss scaling anywhere in the file."""

    code = "AMP109"
    name = "fp16-autocast-no-scaler"
    severity = Severity.ERROR
    message = ("This float16 autocast feeds a backward pass and an optimizer step, but nothing scales the loss: "
               "it computes in float16 on CUDA, and fp16 gradients below about 3e-8 become zero and "
               "training silently stalls. Use a `torch.amp.GradScaler`, or autocast to bfloat16.")
    fix_availability = None
    words = (b"autocast",)
    summary = "float16 autocast in a training step with no `GradScaler` (gradients underflow)."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.scaled = False
        self.flow = u.AutocastFlow()
        self.steps: set[int] = set()  # scopes that step an optimizer
        self.cuda = False  # the file names a CUDA device somewhere
        self.device_dependent: set[int] = set()  # autocasts with a device variable and no dtype

    def visit_Name(self, node: cst.Name) -> None:
        v = node.value.lower()
        if any(w in v for w in _SCALING_WORDS):
            self.scaled = True

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.visit_Name(node.attr)
        if node.attr.value == "cuda":
            self.cuda = True

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if "cuda" in node.value:
            self.cuda = True

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        ac = acs.autocast_call(names, node)
        if ac is not None:
            if self._fp16(ac) and not self._no_grad() and not voc.in_test(self.ctx):  # tests train 2 steps
                self.flow.autocast(self.ctx, node)
                if ac.device is None and ac.dtype_expr is None:
                    self.device_dependent.add(id(node))
            return
        if names.qualified(node.func) == "torch.autograd.backward":
            self.flow.backward_call(self.ctx, node)
            return
        mc = h.method_call(node, "backward", "step")
        if mc is None:
            return
        recv, meth = mc
        if meth == "backward":
            if any(a.keyword is None for a in node.args):
                return  # `accelerator.backward(loss)` and friends scale the loss themselves
            d = (dotted_name(recv) or "").lower()
            if any(w in d for w in _FRAMEWORK_BACKWARD):
                return
            self.flow.backward_call(self.ctx, node)
        elif voc.is_optimizer(names, recv) and not voc.is_scaler(names, recv):
            self.steps.add(id(u.scope_node(self.ctx)))

    def visit_With(self, node: cst.With) -> None:
        self.flow.with_statement(self.ctx, node)

    def _fp16(self, ac: acs.Autocast) -> bool:
        if ac.enabled is False or h.has_star_args(ac.call):
            return False
        if ac.dtype_expr is None:
            if branches.bf16_arm(self.ctx) is not None or \
                    facts_of(self.ctx).evidence.bf16_cast_in(self.ctx.parents):
                return False  # meant to be bf16: AMP301 reports the missing dtype
            # a device variable (`autocast(device.type)`) is fp16 on CUDA: kept when the file uses CUDA
            return ac.device in ("cuda", None)
        return ac.dtype == "float16" and ac.device != "cpu"

    def _no_grad(self) -> bool:
        """Inside `with torch.no_grad()` / `inference_mode()` or a function decorated with them."""
        for p in self.ctx.ancestors():
            if isinstance(p, cst.With):
                for item in p.items:
                    it = item.item
                    if isinstance(it, cst.Call) and self.ctx.names.qualified(it.func) in u.NO_GRAD:
                        return True
            elif isinstance(p, cst.FunctionDef):
                for d in p.decorators:
                    dec = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
                    if self.ctx.names.qualified(dec) in u.NO_GRAD:
                        return True
                return False
        return False

    def leave_Module(self, node: cst.Module) -> None:
        if self.scaled or not self.steps:
            return
        for _block, scope, call in self.flow.feeding(self.ctx.names):
            if id(scope) in self.steps and (self.cuda or id(call) not in self.device_dependent):
                self.report(call)
