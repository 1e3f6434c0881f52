from __future__ import annotations

import re

import libcst as cst
from ampdoctor.lint import tree as _tree

from ampdoctor.diagnostics import Severity
from ampdoctor.lint.semantic import source
from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.rule import Rule

_NAME_CALLS = {"torch.cuda.get_device_name"}
_PROPS_CALLS = {"torch.cuda.get_device_properties"}
# a GPU model as it appears in torch.cuda.get_device_name(): "A100", "RTX 40", "H100", "1660", "T4"...
_GPU = re.compile(r"(?i)^\s*(?:nvidia\s+|geforce\s+|tesla\s+|quadro\s+)*"
                  r"(?:rtx|gtx|titan|tesla|quadro|[ahblvptk]\d{1,4}[a-z]{0,2}|g[bh]\d{2,3}|mi\d{2,3}[a-z]?|"
                  r"\d{3,4}(?:\s*ti)?)(?:\b|\s|$)")
_PRECISION_STRINGS = re.compile(r"(?i)^(bf16|fp16|16-mixed|bf16-mixed|bf16-true|16-true|float16|bfloat16|"
                                r"half|fp32|float32|tf32|amp)$")
_METHODS = ("startswith", "endswith", "find", "index", "count", "__contains__")


def _gpu_string(node: cst.CSTNode) -> str | None:
    s = h.string_value(node)
    return s if s is not None and _GPU.match(s) else None


class GpuNamePrecisionCheck(Rule):
    """Choosing fp16/bf16/AMP by matching ``torch.cuda.get_device_name()`` against model names."""

    code = "AMP309"
    name = "gpu-name-precision-check"
    severity = Severity.WARNING
    message = ("The precision is chosen by matching the GPU name against {names}: this goes wrong on every "
               "card the list leaves out (bf16, for one, also runs on RTX 30xx, A10, L4 and H200) and on every new "
               "one. Ask the device instead: `torch.cuda.is_bf16_supported()` or "
               "`torch.cuda.get_device_capability() >= (8, 0)`.")
    fix_availability = "suggestion"
    words = (b"get_device_name", b"get_device_properties")
    summary = "Precision (fp16/bf16/AMP) chosen from a hard-coded list of GPU names."

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.devname_vars: set[str] = set()
        self.gpu_lists: dict[str, str] = {}
        # tests whose result is stored in a neutral variable: (test, names, var, scope)
        self.deferred: list[tuple[cst.CSTNode, str, str, cst.CSTNode]] = []
        self.done: set[int] = set()
        self.seen: set[int] = set()

    # -- bindings ---------------------------------------------------------------------------
    def leave_Assign(self, node: cst.Assign) -> None:
        targets = [dotted_name(t.target) for t in node.targets]
        if self._is_devname(node.value):
            self.devname_vars.update(t for t in targets if t)
        lst = self._collection(node.value)
        for t in targets:
            if t is None:
                continue
            if lst is not None:
                self.gpu_lists[t] = lst
            else:
                self.gpu_lists.pop(t, None)

    def _is_devname(self, expr: cst.CSTNode) -> bool:
        """Whether ``expr`` reads the GPU name (directly, or through a variable that holds it)."""
        if isinstance(expr, (cst.Name, cst.Attribute)):
            d = dotted_name(expr)
            if d is not None and d in self.devname_vars:
                return True
            if isinstance(expr, cst.Attribute):
                if expr.attr.value == "name" and isinstance(expr.value, cst.Call) and \
                        self.ctx.names.qualified(expr.value.func) in _PROPS_CALLS:
                    return True
                return self._is_devname(expr.value)
            return False
        if isinstance(expr, cst.Call) and self.ctx.names.qualified(expr.func) in _NAME_CALLS:
            return True
        if isinstance(expr, h.SCOPES):
            return False
        return any(self._is_devname(c) for c in _tree.children(expr))

    def _collection(self, expr: cst.CSTNode) -> str | None:
        """The source of a list/tuple/set of strings naming GPUs, or a name bound to one."""
        if isinstance(expr, (cst.List, cst.Tuple, cst.Set)):
            els = [e.value for e in expr.elements if isinstance(e, cst.Element)]
            if els and len(els) == len(expr.elements) and all(h.string_value(e) is not None for e in els) \
                    and any(_gpu_string(e) for e in els):
                return source.short(expr, 50)
            return None
        d = dotted_name(expr)
        if d is not None and d in self.gpu_lists:
            return self.gpu_lists[d]
        return None

    # -- tests ------------------------------------------------------------------------------------
    def visit_Comparison(self, node: cst.Comparison) -> None:
        if len(node.comparisons) != 1:
            return
        op = node.comparisons[0].operator
        right = node.comparisons[0].comparator
        left = node.left
        names = None
        if isinstance(op, (cst.In, cst.NotIn)):
            if self._is_devname(right):
                s = _gpu_string(left)
                if s is not None:
                    names = repr(s)
                elif isinstance(left, cst.Name):
                    names = self._loop_collection(left.value)
            elif self._is_devname(left):
                names = self._collection(right)
        elif isinstance(op, (cst.Equal, cst.NotEqual)):
            for a, b in ((left, right), (right, left)):
                if self._is_devname(a) and _gpu_string(b):
                    names = repr(_gpu_string(b))
        if names is not None:
            self._decide(node, names)

    def visit_Call(self, node: cst.Call) -> None:
        mc = h.method_call(node, *_METHODS)
        if mc is None or not node.args or not self._is_devname(mc[0]):
            return
        a = node.args[0].value
        names = repr(_gpu_string(a)) if _gpu_string(a) else self._collection(a)
        if names is None and isinstance(a, cst.Name):
            names = self._loop_collection(a.value)
        if names is not None:
            self._decide(node, names)

    def _loop_collection(self, var: str) -> str | None:
        """``g in name for g in GPUS`` / ``for g in GPUS: ...``: the collection ``var`` iterates."""
        for p in self.ctx.ancestors():
            fors = []
            if isinstance(p, (cst.GeneratorExp, cst.ListComp, cst.SetComp)):
                f = p.for_in
                while f is not None:
                    fors.append(f)
                    f = f.inner_for_in
            elif isinstance(p, cst.For):
                fors.append(p)
            for f in fors:
                if isinstance(f.target, cst.Name) and f.target.value == var:
                    return self._collection(f.iter)
            if isinstance(p, h.SCOPES):
                break
        return None

    # -- does it decide the precision? --------------------------------------------------------
    def _decide(self, test: cst.CSTNode, names: str) -> None:
        # `"V100" in name or "T4" in name` is one test: report the whole boolean expression once
        stack = self.ctx.parents
        top = len(stack) - 1
        while top > 0 and isinstance(stack[top - 1], (cst.BooleanOperation, cst.UnaryOperation)):
            top -= 1
        if top != len(stack) - 1:
            test = stack[top]
            found = [repr(s) for n in h.walk(test, enter_scopes=True) if (s := _gpu_string(n))]
            if len(found) > 1:
                names = "[" + ", ".join(found) + "]"
        if id(test) in self.seen:
            return
        self.seen.add(id(test))
        scope = next((p for p in self.ctx.ancestors() if isinstance(p, (cst.FunctionDef, cst.Module))), None)
        verdict = self._verdict(stack, top)
        if verdict is True:
            self._flag(test, names)
        elif isinstance(verdict, str) and scope is not None:
            self.deferred.append((test, names, verdict, scope))

    def _verdict(self, stack: list[cst.CSTNode], top: int) -> bool | str | None:
        """Whether the expression at ``stack[top]`` decides a precision setting: True, False/None,
        or the name of the neutral variable it is stored in (``is_ampere = ...``)."""
        for i in range(top - 1, -1, -1):
            p, child = stack[i], stack[i + 1]
            ctx_nodes: list[cst.CSTNode] = []
            if isinstance(p, cst.IfExp) and child is p.test:
                ctx_nodes = [p.body, p.orelse]
            elif isinstance(p, (cst.If, cst.While)) and child is p.test:
                ctx_nodes = [p.body] + ([p.orelse] if getattr(p, "orelse", None) is not None else [])
            elif isinstance(p, cst.Return):
                fn = next((a for a in stack[:i][::-1] if isinstance(a, cst.FunctionDef)), None)
                ctx_nodes = [fn.name] if fn is not None else []
                if p.value is not None and not isinstance(p.value, cst.Tuple):
                    ctx_nodes.append(p.value)
            elif isinstance(p, cst.Arg) and p.keyword is not None:
                ctx_nodes = [p.keyword, stack[i - 1]] if i > 0 else [p.keyword]
            elif isinstance(p, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
                targets = [t.target for t in p.targets] if isinstance(p, cst.Assign) else [p.target]
                if self._precision(targets):
                    return True
                if isinstance(p, cst.Assign) and len(targets) == 1 and isinstance(targets[0], cst.Name):
                    return targets[0].value
                return None
            elif isinstance(p, (cst.Tuple, cst.List, cst.Set, cst.Dict)):
                return None  # one item among others (`return use_flash, dtype`)
            if ctx_nodes:
                return self._precision(ctx_nodes)
            if isinstance(p, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                return None
        return None

    def leave_Module(self, node: cst.Module) -> None:
        for test, names, var, scope in self.deferred:
            if id(test) in self.done:
                continue
            for stack in self._uses(scope, var):
                if self._verdict(stack, len(stack) - 1) is True:
                    self._flag(test, names)
                    break

    @staticmethod
    def _uses(scope: cst.CSTNode, var: str):
        """Ancestor stacks (the use last) of each read of ``var`` in ``scope``, nested defs excluded."""
        out = []

        def visit(n: cst.CSTNode, stack: list[cst.CSTNode]) -> None:
            stack.append(n)
            if isinstance(n, cst.Name) and n.value == var:
                parent = stack[-2] if len(stack) > 1 else None
                if not isinstance(parent, (cst.AssignTarget, cst.Attribute)) or \
                        (isinstance(parent, cst.Attribute) and parent.value is n):
                    out.append(list(stack))
            if n is scope or not isinstance(n, h.SCOPES):
                for c in _tree.children(n):
                    visit(c, stack)
            stack.pop()

        visit(scope, [])
        return out

    def _precision(self, nodes: list[cst.CSTNode]) -> bool:
        for node in nodes:
            for n in [node, *h.walk(node, enter_scopes=True)]:
                if isinstance(n, cst.Name) and voc.PRECISION_WORDS.intersection(voc.words(n.value)):
                    return True
                s = h.string_value(n)
                if s is not None and _PRECISION_STRINGS.match(s.strip()):
                    return True
        return False

    def _flag(self, test: cst.CSTNode, names: str) -> None:
        self.done.add(id(test))
        self.report(test, self.message.format(names=f"`{names}`"))
