from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import autocast as acs
from ampdoctor.lint.semantic.backward import FUNCTION_BASES

# ops on autocast's lower-precision list (CUDA), by qualified name
_OPS = {f"torch.nn.functional.{n}" for n in (
    "linear", "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "conv_tbc")}
_OPS |= {f"torch.{n}" for n in ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv",
                                "conv1d", "conv2d", "conv3d", "chain_matmul")}
_OPS |= {"torch.linalg.multi_dot"}
_METHODS = ("matmul", "mm", "bmm", "addmm", "baddbmm")


class CustomFunctionNoCustomFwd(Rule):
    """An ``autograd.Function`` whose forward runs autocastable ops, without ``custom_fwd``."""

    code = "AMP305"
    name = "custom-function-no-custom-fwd"
    severity = Severity.WARNING
    message = ("`{cls}.forward` has no `@torch.amp.custom_fwd`: it runs `{op}`, which autocast lowers to "
               "float16, and `backward` then runs outside autocast on mismatched dtypes. "
               "Decorate `forward` with `@torch.amp.custom_fwd(device_type=\"cuda\")` (add "
               "`cast_inputs=torch.float32` to run it in float32) and `backward` with "
               "`@torch.amp.custom_bwd(device_type=\"cuda\")`.")
    fix_availability = "suggestion"
    words = (b"Function",)
    also = (b"autocast",)
    summary = "Custom `autograd.Function` with autocastable ops and no `custom_fwd`/`custom_bwd`."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.uses_autocast = False
        self.pending: list[tuple[str, cst.CSTNode, str]] = []
        # class name -> for each `Cls.apply(...)`: whether autocast is disabled around it
        self.applies: dict[str, list[bool]] = {}

    def visit_Call(self, node: cst.Call) -> None:
        if not self.uses_autocast and self.ctx.names.qualified(node.func) in acs.AUTOCAST_ALL:
            self.uses_autocast = True
        mc = h.method_call(node, "apply")
        if mc is not None and isinstance(mc[0], cst.Name):
            rs = acs.regions(self.ctx)
            self.applies.setdefault(mc[0].value, []).append(bool(rs) and rs[0].ac.enabled is False)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        if not any(self.ctx.names.qualified(b.value) in FUNCTION_BASES for b in node.bases):
            return
        if not isinstance(node.body, cst.IndentedBlock):
            return
        fwd = next((s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "forward"),
                   None)
        if fwd is None or self._handles_autocast(fwd):
            return
        op = self._autocast_op(fwd)
        if op is None:
            return
        self.pending.append((node.name.value, fwd.name, self.message.format(cls=node.name.value, op=op)))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.uses_autocast:
            return
        for cls, n, msg in self.pending:
            calls = self.applies.get(cls)
            if calls and all(calls):
                continue  # only ever applied inside `autocast(enabled=False)` (on cast inputs)
            self.report(n, msg)

    def _handles_autocast(self, fwd: cst.FunctionDef) -> bool:
        for d in fwd.decorators:
            expr = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
            name = dotted_name(expr) or ""
            if "custom_fwd" in name or "autocast" in name.lower() or "amp" in voc.words(name):
                return True
        # a forward that manages autocast itself (reads its state, disables it)
        for n in h.walk(fwd.body):
            if isinstance(n, cst.Name) and "autocast" in n.value.lower():
                return True
        return False

    def _autocast_op(self, fwd: cst.FunctionDef) -> str | None:
        for n in h.walk(fwd.body):
            if isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.MatrixMultiply):
                return "@"
            if isinstance(n, cst.Call):
                q = self.ctx.names.qualified(n.func)
                if q in _OPS:
                    return q.replace("torch.nn.functional.", "F.")
                mc = h.method_call(n, *_METHODS)
                if mc is not None and self.ctx.names.qualified(mc[0]) != "torch":
                    return f".{mc[1]}()"
        return None
