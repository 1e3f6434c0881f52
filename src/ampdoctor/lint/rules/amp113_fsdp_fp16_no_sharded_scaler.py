from __future__ import annotations

import libcst as cst

from ampdoctor.diagnostics import Severity
from ampdoctor.lint import helpers as h
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic.backward import is_backward_call
from ampdoctor.lint.semantic import casts as conv
from ampdoctor.lint.semantic import source
from ampdoctor.lint.semantic.facts import facts_of

_FSDP = {"torch.distributed.fsdp.FullyShardedDataParallel", "torch.distributed.fsdp.fully_sharded_data_parallel."
         "FullyShardedDataParallel", "torch.distributed.fsdp.fully_shard", "torch.distributed._composable.fsdp."
         "fully_shard", "torch.distributed.fsdp._fully_shard.fully_shard"}
_POLICIES = {"MixedPrecision", "MixedPrecisionPolicy"}
_CHOICE = "choice:"  # a policy whose param_dtype is a configured choice including float16


class FsdpFp16NoShardedScaler(Rule):
    """FSDP with float16 parameters and no ``ShardedGradScaler``."""

    code = "AMP113"
    name = "fsdp-fp16-no-sharded-scaler"
    severity = Severity.ERROR
    message = ("FSDP computes in float16 here but this code builds no `ShardedGradScaler`: the policy is "
               "`{policy}`, and {why} Use "
               "`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`, or `param_dtype=torch.bfloat16`.")
    choice_message = ("FSDP can compute in float16 here but this code builds no `ShardedGradScaler`: the "
                      "policy's `param_dtype={p}` can select torch.float16, and then {why} Use "
                      "`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` for that choice.")
    fix_availability = "suggestion"
    words = (b"MixedPrecision",)
    also = (b"float16", b"half")
    summary = "FSDP `MixedPrecision(param_dtype=torch.float16)` trained without a `ShardedGradScaler`."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.policies: dict[str, str] = {}  # name bound to a float16 policy -> its source
        self.wraps: list[tuple[cst.Call, str, tuple[int, ...]]] = []
        self.sharded: set[int] = set()  # scopes (def/class ids, 0 for the module) that build a ShardedGradScaler
        self.plain: set[int] = set()  # ... a plain GradScaler
        self.trains = False  # the file runs a backward pass

    def _scopes(self) -> tuple[int, ...]:
        """The innermost def, the class around it, or the module (0)."""
        out = []
        for p in self.ctx.ancestors():
            if isinstance(p, cst.FunctionDef) and not out:
                out.append(id(p))
            elif isinstance(p, cst.ClassDef):
                out.append(id(p))
                break
        return tuple(out) or (0,)

    def _fp16_policy(self, node: cst.BaseExpression) -> str | None:
        if isinstance(node, cst.Name):
            return self.policies.get(node.value)
        if not isinstance(node, cst.Call):
            return None
        q = self.ctx.names.qualified(node.func) or ""
        if q.rsplit(".", 1)[-1] not in _POLICIES:
            return None
        p = h.arg(node, 0, "param_dtype")
        if p is not None and h.dtype_of(self.ctx.names, p) == "float16":
            text = " ".join(cst.Module([]).code_for_node(node).split())
            return text if len(text) <= 50 else text.split("(", 1)[0] + "(param_dtype=torch.float16, ...)"
        if p is not None and "float16" in conv.selectable_dtypes(self.ctx.names, p, facts_of(self.ctx)):
            # `param_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[args.mixed_precision]`
            return _CHOICE + source.short(p, 40)
        return None

    def leave_Assign(self, node: cst.Assign) -> None:
        src = self._fp16_policy(node.value)
        for t in node.targets:
            if isinstance(t.target, cst.Name):
                if src is not None:
                    self.policies[t.target.value] = src
                else:
                    self.policies.pop(t.target.value, None)

    def visit_Call(self, node: cst.Call) -> None:
        q = self.ctx.names.qualified(node.func) or ""
        last = q.rsplit(".", 1)[-1]
        if last == "ShardedGradScaler":
            self.sharded.update(self._scopes())
            return
        if last == "GradScaler":
            self.plain.update(self._scopes())
            return
        if "Scaler" in last:
            # a scaler class this file cannot see into (LLaMA-Adapter's NativeScalerWithGradNormCount
            # holds a ShardedGradScaler): it may be the sharded one
            self.sharded.update(self._scopes())
            return
        if is_backward_call(self.ctx.names, node):
            self.trains = True
            return
        if q in _FSDP or last in ("FullyShardedDataParallel", "FSDP", "fully_shard"):
            for key in ("mixed_precision", "mp_policy"):
                v = h.arg(node, None, key)
                src = self._fp16_policy(v) if v is not None else None
                if src is not None:
                    self.wraps.append((node, src, self._scopes()))

    def leave_Module(self, node: cst.Module) -> None:
        if not self.trains:
            return  # no backward here: a tool that only loads, converts or evaluates the wrapped model
        for call, src, scopes in self.wraps:
            if self.sharded & set(scopes) or (0 in self.sharded and scopes == (0,)):
                continue
            plain = bool(self.plain & set(scopes))
            why = ("a plain GradScaler sees only this rank's shard of the gradients, so ranks disagree on whether "
                   "to skip a step and the unscale misses the other shards." if plain else
                   "without loss scaling float16 gradients below about 6e-8 underflow to 0 and training stalls.")
            if src.startswith(_CHOICE):
                self.report(call, self.choice_message.format(p=src[len(_CHOICE):], why=why))
            else:
                self.report(call, self.message.format(policy=src, why=why))
