"""Low-precision evidence: is there reason to think this code computes in float16?

One pass over the file collects every float16 fact with its strength and its scope:

- strong, file-wide: a model or its weights made float16 (``model.half()``,
  ``Net(...).to(torch.float16)``, ``from_pretrained(..., torch_dtype=torch.float16)``),
  float16 autocast, an enabled GradScaler, ``set_default_dtype(torch.float16)``, a float16
  switch in the configuration (``--fp16``, ``fp16=True``, ``precision="16-mixed"``).
- weak, scoped: a stray mention, such as a tensor cast (``torch.randn(3).half()``), a
  ``dtype=torch.float16`` factory or an ``fp16`` identifier; it counts only for code in the
  same function or class.

Numerics rules ask ``fp16_for(stack)`` with the ancestors of the node they judge.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from ampdoctor.lint import helpers as h
from ampdoctor.lint import tree
from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.semantic.autocast import autocast_call
from ampdoctor.lint.semantic.casts import cast_target

STRONG = 2
WEAK = 1

_HALF_QUALIFIED = {"torch.float16", "torch.half", "torch.cuda.HalfTensor", "torch.HalfTensor"}
_FP16_STRINGS = {"fp16", "float16", "16-mixed", "16-true", "--fp16", "--half", "half"}
_FACTORIES = {"torch.tensor", "torch.zeros", "torch.ones", "torch.full", "torch.empty", "torch.rand", "torch.randn",
              "torch.randint", "torch.arange", "torch.linspace", "torch.eye", "torch.as_tensor", "torch.from_numpy",
              "torch.zeros_like", "torch.ones_like", "torch.empty_like", "torch.randn_like", "torch.rand_like",
              "torch.full_like", "torch.stack", "torch.cat"}
_MODEL_WORDS = ("model", "net", "module", "encoder", "decoder", "unet", "vae", "transformer", "backbone", "generator",
                "discriminator", "critic", "actor", "policy", "teacher", "student", "pipe", "pipeline", "llm",
                "classifier", "detector", "embed", "layer", "block", "head")
_MODEL_NAMES = {"g", "d", "netg", "netd", "m"}
_FLAG_KEYWORDS = {"fp16", "half", "use_fp16", "use_half", "fp16_enabled", "amp_fp16"}


@dataclass
class Fact:
    node: cst.CSTNode
    text: str
    strength: int
    scope: int  # id of the innermost def/class around it, 0 at module level
    kind: str  # "cast" (weights or tensors made float16), "autocast", "scaler", "config", "mention"


def _code(node: cst.CSTNode) -> str:
    return " ".join(cst.Module([]).code_for_node(node).split())


class Evidence:
    def __init__(self, module: cst.Module, calls) -> None:
        self.calls = calls  # semantic.calls.CallGraph
        self.names: Names = calls.names
        self.facts: list[Fact] = []
        self.bf16_casts: set[int] = set()  # scopes (def/class ids, 0 for module level) that cast to bfloat16
        self._training: dict[int, bool] = {}
        # (call, scope) where a model's weights are cast to (or loaded in) float16, bfloat16 or a
        # configured dtype: inputs cast to that dtype by hand then match the weights
        self.low_precision_models: list[tuple[cst.Call, int]] = []
        # the dtype each enabled autocast of the file computes in (None: not known statically)
        self.autocast_dtypes: list[str | None] = []
        self._walk(module)

    @property
    def bf16_autocast_only(self) -> bool:
        """The file autocasts, and every region computes in bfloat16: a GradScaler here has
        nothing to do (bf16 has float32's range)."""
        return bool(self.autocast_dtypes) and all(d == "bfloat16" for d in self.autocast_dtypes)

    def fp16_for(self, stack: list[cst.CSTNode], kinds: tuple[str, ...] | None = None) -> Fact | None:
        """The float16 evidence (of ``kinds``, default all) that applies to the last node of
        ``stack`` (its ancestors): strong evidence anywhere, else weak evidence in an enclosing
        def or class."""
        facts = [f for f in self.facts if kinds is None or f.kind in kinds]
        strong = next((f for f in facts if f.strength == STRONG), None)
        if strong is not None:
            return strong
        scopes = self._scopes(stack)
        return next((f for f in facts if f.scope in scopes), None)

    def fp16_near(self, stack: list[cst.CSTNode]) -> Fact | None:
        """Float16 evidence about this code itself: a model made float16 anywhere in the file, a
        GradScaler or an fp16 switch (the file trains in float16), a float16 autocast in code that
        trains, or any fact in an enclosing def or class or an in-file caller. An inference-only
        autocast elsewhere (a `main()` that decodes one image) does not say this code runs in it."""
        for f in self.facts:
            if f.strength == STRONG and (f.kind in ("cast", "scaler", "config") or
                                         f.kind == "autocast" and self._trains(f.scope)):
                return f  # the file's model, or the file's own training, runs in float16
        scopes = self._scopes(stack)
        return next((f for f in self.facts if f.scope in scopes), None)

    def _trains(self, scope: int) -> bool:
        """Module-level code, or a function that runs a backward pass or an optimizer step."""
        if scope == 0:
            return True
        hit = self._training.get(scope)
        if hit is None:
            fn = self.calls.functions.get(scope)
            hit = fn is not None and any(
                h.method_call(n, "backward") is not None or h.method_call(n, "step") is not None
                for n in h.walk(fn.node.body))
            self._training[scope] = hit
        return hit

    def _scopes(self, stack: list[cst.CSTNode]) -> set[int]:
        scopes = {id(p) for p in stack if isinstance(p, (cst.FunctionDef, cst.ClassDef))}
        fn = next((p for p in reversed(stack) if isinstance(p, cst.FunctionDef)), None)
        if fn is not None:
            scopes |= self._callers(fn)
        return scopes

    def _callers(self, fn: cst.FunctionDef, depth: int = 2) -> set[int]:
        """Scopes that call ``fn`` in this file (0 for module-level code), up to ``depth`` calls up:
        data made float16 there reaches it."""
        out: set[int] = set()
        todo = [(fn, 0)]
        while todo:
            node, d = todo.pop()
            info = self.calls.function(node)
            if info is None or d >= depth:
                continue
            for site in info.sites:
                if site.caller is None:
                    out.add(0)
                elif id(site.caller.node) not in out:
                    out.add(id(site.caller.node))
                    todo.append((site.caller.node, d + 1))
        return out

    def bf16_cast_in(self, stack: list[cst.CSTNode]) -> bool:
        """The innermost def around the last node of ``stack`` casts something to bfloat16
        (``model.to(torch.bfloat16)``, ``x.bfloat16()``): that code is configured for bf16."""
        for p in reversed(stack):
            if isinstance(p, cst.FunctionDef):
                return id(p) in self.bf16_casts
        return 0 in self.bf16_casts

    # -- collection --------------------------------------------------------------------
    def _add(self, node: cst.CSTNode, strength: int, scope: int, kind: str) -> None:
        self.facts.append(Fact(node, _code(node)[:60], strength, scope, kind))

    def _walk(self, module: cst.Module) -> None:
        stack: list[tuple[cst.CSTNode, int]] = [(module, 0)]
        while stack:
            node, scope = stack.pop()
            inner = id(node) if isinstance(node, (cst.FunctionDef, cst.ClassDef)) else scope
            self._judge(node, scope)
            kids = tree.children(node)
            for i in range(len(kids) - 1, -1, -1):
                stack.append((kids[i], inner))

    def _judge(self, n: cst.CSTNode, scope: int) -> None:
        names = self.names
        t = type(n)
        if t is cst.Call:
            q = names.qualified(n.func) or ""
            ac = autocast_call(names, n)
            if ac is not None:
                if ac.enabled is not False:
                    self.autocast_dtypes.append(ac.effective_dtype)
                if ac.enabled is not False and (ac.dtype == "float16" or
                                                (ac.dtype_expr is None and ac.device in ("cuda", None))):
                    self._add(n, STRONG, scope, "autocast")
                return
            if voc.is_grad_scaler_name(q):
                en = h.arg(n, None, "enabled")
                if not (isinstance(en, cst.Name) and en.value == "False"):
                    self._add(n, STRONG, scope, "scaler")
                return
            if q in ("torch.set_default_dtype", "torch.set_default_tensor_type") and n.args:
                a = n.args[0].value
                if h.dtype_of(names, a) == "float16" or (names.qualified(a) or "").endswith("HalfTensor"):
                    self._add(n, STRONG, scope, "cast")
                return
            target = cast_target(names, n)
            if target == "bfloat16":
                self.bf16_casts.add(scope)
            if target in ("float16", "bfloat16", "?") and self._model_receiver(n.func.value):  # type: ignore[attr-defined]
                self.low_precision_models.append((n, scope))  # `model.to(dtype)`, `net.bfloat16()`
            if target == "float16":
                self._add(n, STRONG if self._model_receiver(n.func.value) else WEAK, scope, "cast")  # type: ignore[attr-defined]
                return
            mc = h.method_call(n, "add_argument")
            if mc is not None:
                opts = [(h.string_value(a.value) or "").lstrip("-").replace("-", "_").lower()
                        for a in n.args if a.keyword is None]
                if any(o in _FLAG_KEYWORDS for o in opts):
                    self._add(n, STRONG, scope, "config")
                return
            for a in n.args:
                if a.keyword is None:
                    continue
                k = a.keyword.value
                if k == "torch_dtype" and h.dtype_of(names, a.value) != "float32" and \
                        not (isinstance(a.value, cst.SimpleString) and h.string_value(a.value) == "auto"):
                    self.low_precision_models.append((n, scope))  # weights loaded 16-bit or configured
                if k in ("torch_dtype", "dtype") and self._maybe_fp16(a.value):
                    strong = k == "torch_dtype" or q.rsplit(".", 1)[-1] == "from_pretrained"
                    self._add(n, STRONG if strong and q not in _FACTORIES else WEAK, scope, "cast")
                    return
                if k in _FLAG_KEYWORDS and isinstance(a.value, cst.Name) and a.value.value == "True":
                    self._add(n, STRONG, scope, "config")
                    return
                if k in ("precision", "mixed_precision"):
                    v = (h.string_value(a.value) or "").lower()
                    if v in _FP16_STRINGS or h.number_value(a.value) == 16:
                        self._add(n, STRONG, scope, "config")
                        return
        elif t is cst.Assign:
            for target in n.targets:
                last = (dotted_name(target.target) or "").rsplit(".", 1)[-1].lower()
                if last in _FLAG_KEYWORDS and isinstance(n.value, cst.Name) and n.value.value == "True":
                    self._add(n, STRONG, scope, "config")
        elif t is cst.Attribute:
            if names.qualified(n) in _HALF_QUALIFIED or "fp16" in n.attr.value.lower():
                self._add(n, WEAK, scope, "mention")
        elif t is cst.Name:
            if "fp16" in n.value.lower() or names.qualified(n) in _HALF_QUALIFIED:
                self._add(n, WEAK, scope, "mention")
        elif t is cst.SimpleString:
            v = (h.string_value(n) or "").lower()
            if v in _FP16_STRINGS - {"half"}:
                self._add(n, WEAK, scope, "mention")

    def _maybe_fp16(self, value: cst.BaseExpression) -> bool:
        if h.dtype_of(self.names, value) == "float16":
            return True
        if isinstance(value, cst.IfExp):
            return self._maybe_fp16(value.body) or self._maybe_fp16(value.orelse)
        if isinstance(value, (cst.Name, cst.Attribute)):
            return False
        return any(h.dtype_of(self.names, m) == "float16" for m in h.walk(value) if isinstance(m, (cst.Name, cst.Attribute)))

    def _model_receiver(self, recv: cst.BaseExpression) -> bool:
        """``model``, ``self.unet``, ``Net(...).cuda()``: a model, not a tensor."""
        while isinstance(recv, cst.Call) and isinstance(recv.func, cst.Attribute):
            if recv.func.attr.value in ("cuda", "to", "cpu", "eval", "train", "float", "requires_grad_"):
                recv = recv.func.value
            else:
                break
        if isinstance(recv, cst.Call):
            q = self.names.qualified(recv.func) or ""
            if q in _FACTORIES or q.startswith(("torch.", "np.", "numpy.")):
                # `torch.nn.Linear(...)` is a module; `torch.nn.functional.one_hot(...)` a tensor
                return q.startswith("torch.nn.") and q.rsplit(".", 1)[-1][:1].isupper()
            last = q.rsplit(".", 1)[-1]
            return last[:1].isupper() or last == "from_pretrained"
        d = dotted_name(recv)
        if d is None:
            return False
        made = self.names.made_by(recv) or ""
        if made in _FACTORIES:
            return False
        if made.startswith(("torch.", "numpy.", "np.")) and not made.rsplit(".", 1)[-1][:1].isupper():
            return False  # `D = torch.nn.functional.normalize(D)`: a tensor, whatever its name
        if made.rsplit(".", 1)[-1][:1].isupper() or made.rsplit(".", 1)[-1] == "from_pretrained":
            return True
        last = d.rsplit(".", 1)[-1].lower()
        # `G`, `D`, `m`: a GAN's nets or a model when nothing says otherwise; `D = self.doc(...)`
        # (a function's result) is data
        return d == "self" or (last in _MODEL_NAMES and not made) or any(w in last for w in _MODEL_WORDS)
