"""The GradScaler protocol: the loss-scaling events of a file in source order.

``ScalerFlow`` is a Rule base class (it is not registered: it lives outside the rules
package) that records, while the engine walks the file, every event of the loss-scaling
protocol with enough context to compare two events afterwards:

- ``scale_bw``  ``S.scale(L).backward()`` (also through ``x = S.scale(L); x.backward()``)
- ``maybe_bw``  ``L.backward()`` where L went through some other ``*scale*`` call
- ``plain_bw``  ``L.backward()`` on an unscaled tensor
- ``unscale``   ``S.unscale_(opt)``; ``unscale_any`` any other call named ``*unscale*``
- ``step``      ``S.step(opt)``; ``update`` ``S.update()``
- ``plain_step`` ``opt.step()`` on an optimizer-like receiver
- ``zero_grad`` ``opt.zero_grad()`` or ``model.zero_grad()``
- ``clip``      gradient clipping, or a magnitude read of ``p.grad``

Rules then decide in ``decide()``, called at the end of the file. Two events ``a`` (earlier) and ``b`` (later) of one
function can run in the same pass when ``reaches(a, b)``: they are not in exclusive
branches (the same ``if``, or two ``if``s with the same condition, one negated), and no
``return``/``raise``/``continue``/``break`` after ``a`` ends its block before ``b``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst

from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.semantic import config, source
from ampdoctor.lint.rule import Rule
from ampdoctor.lint.semantic import vocabulary as voc
from ampdoctor.lint.semantic import values
from ampdoctor.lint.semantic.facts import facts_of

_CODE = cst.Module([])

CLIP_FUNCS = {
    "torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_norm", "torch.nn.utils.clip_grad_value_",
    "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm",
    "torch.nn.utils.clip_grad.clip_grad_value_", "torch.nn.utils.clip_grads_with_norm_",
    "torch.nn.utils.clip_grad.clip_grads_with_norm_",
    "timm.utils.dispatch_clip_grad", "timm.utils.clip_grad.dispatch_clip_grad",
    "timm.utils.adaptive_clip_grad", "timm.utils.agc.adaptive_clip_grad",
}


def clips_gradients(names, node: cst.CSTNode) -> bool:
    """A call that clips gradients, whatever it is given: ``torch.nn.utils.clip_grad_norm_``,
    timm's ``dispatch_clip_grad``, ``model.clip_grad_norm_`` (FSDP), ``accelerator.clip_grad_norm_``,
    a clipper method (``self.clip_grad_value(...)``)."""
    if not isinstance(node, cst.Call):
        return False
    if names.qualified(node.func) in CLIP_FUNCS:
        return True
    return isinstance(node.func, cst.Attribute) and node.func.attr.value.startswith(("clip_grad", "clip_grads"))


# functions that measure whatever they are given: a clip event when given ``.grad`` tensors
NORM_FUNCS = {
    "torch.nn.utils.get_total_norm", "torch.nn.utils.clip_grad.get_total_norm", "torch.norm",
    "torch.linalg.norm", "torch.linalg.vector_norm", "torch.linalg.matrix_norm", "torch._foreach_norm",
    "torch.clamp", "torch.clip", "torch.abs", "torch.max", "torch.amax", "torch.min", "torch.amin",
}
# tensor methods whose result depends on the magnitude of the gradient
MAGNITUDE_METHODS = {"norm", "clamp", "clamp_", "clip", "clip_", "abs", "abs_", "max", "min", "amax", "amin",
                     "pow", "square", "std", "var"}
_FSDP = ("FullyShardedDataParallel", "FSDP")
_ACCUM_WORDS = ("accum", "sync_grad", "should_step", "do_step", "step_now", "should_update", "do_update",
                "is_update_step", "update_step", "optimizer_step", "optim_step")
_WRAPPER_WORDS = ("accelerator", "engine", "fabric", "trainer", "strategy", "precision", "plugin", "wrapper",
                  "deepspeed", "manager", "self")


def code_of(node: cst.CSTNode) -> str:
    return source.code(node).strip()


def short(text: str, limit: int = 48) -> str:
    return source.short(text, limit)


def strip_parens(expr: cst.BaseExpression) -> cst.BaseExpression:
    if getattr(expr, "lpar", None):
        return expr.with_changes(lpar=[], rpar=[])
    return expr


# -- conditions ------------------------------------------------------------------------

def cond_key(test: cst.BaseExpression) -> tuple[str, bool, tuple[str, str] | None]:
    """A normal form of an ``if`` test, whether the test is its positive form, and for an
    equality with a literal the (left, literal) pair: ``not x`` -> (x, False),
    ``x is None`` -> (x, False), ``x is not None`` -> (x, True), ``a != "b"`` -> (a == "b", False)."""
    positive = True
    while True:
        while getattr(test, "lpar", None):
            test = test.with_changes(lpar=[], rpar=[])
        if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            positive = not positive
            test = test.expression
            continue
        break
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        comp = test.comparisons[0]
        op = comp.operator
        right = comp.comparator
        if isinstance(right, cst.Name) and right.value == "None" and isinstance(op, (cst.Is, cst.IsNot)):
            key, pos, _ = cond_key(test.left)
            here = pos if isinstance(op, cst.IsNot) else not pos
            return key, here if positive else not here, None
        if isinstance(op, (cst.Equal, cst.NotEqual)):
            left = " ".join(code_of(test.left).split())
            lit = " ".join(code_of(right).split())
            pos = isinstance(op, cst.Equal)
            eq = (left, lit) if isinstance(right, (cst.SimpleString, cst.Integer, cst.Float)) else None
            return f"{left} == {lit}", pos if positive else not pos, eq
    return " ".join(code_of(test).split()), positive, None


_AMP_TOKENS = {"amp", "scaler", "fp16", "float16", "half", "mixed", "precision", "bf16", "bfloat16", "fp32",
               "float32", "apex", "autocast", "fp8"}


def amp_related(test: cst.BaseExpression) -> bool:
    """The test selects a precision mode (``use_amp``, ``scaler is not None``, ``args.fp16``)."""
    return any(t in _AMP_TOKENS for t in re.split(r"[^a-z0-9]+", code_of(test).lower()))


def accumulation_like(test: cst.BaseExpression) -> bool:
    """An ``if`` test that looks like a gradient-accumulation boundary. A mode switch that only
    says accumulation is on (``if ACCUMULATION_STEPS > 1:``) is not one."""
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and \
            h.number_value(test.comparisons[0].comparator) in (0, 1, 2) and \
            not any(isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.Modulo)
                    for n in h.walk(test, enter_scopes=True)):
        return False
    for n in [test, *h.walk(test, enter_scopes=True)]:
        if isinstance(n, cst.BinaryOperation) and isinstance(n.operator, cst.Modulo):
            return True
        if isinstance(n, cst.Name):
            low = n.value.lower()
            if any(w in low for w in _ACCUM_WORDS):
                return True
    return False


@dataclass(frozen=True)
class Cond:
    if_id: int
    key: str
    truth: bool  # the value the (normalised) test has on this path
    accumulation: bool
    in_loop: bool  # the ``if`` lies between the event and its innermost loop
    text: str
    node: cst.CSTNode = field(compare=False, hash=False, repr=False, default=None)  # type: ignore[assignment]
    in_body: bool = True  # the event is in the body (not the else/elif part)
    eq: tuple[str, str] | None = None  # `x == "literal"`: (x, "literal")
    amp: bool = False  # the test selects a precision mode

    def other_branch_exits(self) -> bool:
        """The other branch of this ``if`` ends with ``continue``/``break``/``return``/``raise``."""
        node = self.node
        if not isinstance(node, cst.If):
            return False
        if self.in_body:
            other = node.orelse  # an Else, or the If of an elif
            block = other.body if isinstance(other, (cst.If, cst.Else)) else None
        else:
            block = node.body
        if not isinstance(block, cst.IndentedBlock):
            return False
        return any(isinstance(st, cst.SimpleStatementLine) and any(
            isinstance(x, (cst.Continue, cst.Break, cst.Return, cst.Raise)) for x in st.body) for st in block.body)


@dataclass
class Event:
    kind: str
    node: cst.CSTNode
    scaler: str | None
    arg: str | None  # the optimizer text (step/unscale/plain_step), the clip description
    region: int
    loop: int | None
    order: int
    branches: tuple
    conds: tuple[Cond, ...]
    anc: frozenset[int]
    exits: tuple[tuple[int, int | None], ...]  # (block id, loop id or None): flow ends in that block
    statement: tuple | None
    extra: dict = field(default_factory=dict)

    def inside(self, node_id: int) -> bool:
        return node_id in self.anc


def _given_parameters(call: cst.Call) -> bool:
    """One of the arguments is `X.parameters()` (or `named_parameters()`), or a `*params*` name."""
    for a in call.args:
        v = a.value
        if isinstance(v, cst.Call) and isinstance(v.func, cst.Attribute) and \
                v.func.attr.value in ("parameters", "named_parameters"):
            return True
        if "param" in (dotted_name(v) or "").rsplit(".", 1)[-1].lower():
            return True
    return False


def exclusive(a: Event, b: Event) -> bool:
    """The two events can never run in the same pass (if/else, or correlated ``if``s)."""
    if h.exclusive(a.branches, b.branches):
        return True
    for c1 in a.conds:
        for c2 in b.conds:
            if (c1.if_id == c2.if_id or c1.key == c2.key) and c1.truth != c2.truth:
                return True
            if c1.eq and c2.eq and c1.truth and c2.truth and c1.eq[0] == c2.eq[0] and c1.eq[1] != c2.eq[1]:
                return True  # `if mode == "amp":` ... `if mode == "fp32":`
    return False


def reaches(a: Event, b: Event) -> bool:
    """``b`` (later in the source) may run after ``a`` in the same pass of their function."""
    if a.region != b.region or exclusive(a, b):
        return False
    for block, loop in a.exits:
        if b.inside(block):
            continue
        if loop is not None and not b.inside(loop):
            continue  # `continue`/`break` only end the loop, code after it still runs
        return False
    return True


_DATA_WORDS = ("loader", "data", "batch", "dataset", "iterator", "iter", "dl", "sample", "epoch", "tqdm")


def _data_loop(loop: cst.CSTNode) -> bool:
    """A loop over the data (``for batch in loader``, ``enumerate(train_dl)``, a ``range`` whose
    body draws ``next(it)``): one pass is one training iteration, so its update cannot be the
    caller's. ``for _ in range(self.gen_steps)`` is a round of steps inside one iteration."""
    if isinstance(loop, cst.For):
        words = [w.lower() for w in h.names_in(loop.iter)]
        if any(any(d in w for d in _DATA_WORDS) for w in words if w not in ("range", "len", "enumerate")):
            return True
        body = loop.body
    else:
        body = loop.body  # type: ignore[attr-defined]
    return any(isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value == "next"
               for n in h.walk(body))


def _loop_names(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value.lower()}
    if isinstance(target, (cst.Tuple, cst.List)):
        return set().union(*(_loop_names(e.value) for e in target.elements))
    return set()


def _per_item_names(loop: cst.For) -> set[str]:
    """The loop variable and names the body binds from it (``optimizer = self.optimizers[group]``)."""
    names = _loop_names(loop.target)
    for n in h.walk(loop.body):
        if isinstance(n, cst.Assign) and {x.lower() for x in h.names_in(n.value)} & names:
            for t in n.targets:
                names |= _loop_names(t.target)
    return names


# -- receivers ---------------------------------------------------------------------------

def _wrapper_receiver(expr: cst.BaseExpression) -> bool:
    d = dotted_name(expr)
    if d is None:
        return False
    last = d.rsplit(".", 1)[-1].lower()
    return any(w in last for w in _WRAPPER_WORDS) or last in ("model", "module", "amp")


# -- the collector ------------------------------------------------------------------------

class ScalerFlow(Rule):
    """Base class: collects protocol events; subclasses implement ``decide()``."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.events: list[Event] = []
        # per region: dotted names currently holding a scaled loss -> the scaler (or "?")
        self._scaled: dict[tuple[int, str], str] = {}
        self._seen_statements: set[int] = set()
        # scalers built with a literal `enabled=False`: (function id, name), or (0, "self.x")
        self._disabled: set[tuple[int, str]] = set()
        # scalers built with init_scale=1: (function id, name), or (0, "self.x")
        self.unit_scale: set[tuple[int, str]] = set()
        # calls of this file's own functions, as "call" events (extra: callee, the Function); kept
        # apart from ``events`` so the protocol rules see only scaler events there. Their
        # ``order`` is that of the next protocol event: a call precedes event e when order <= e.order
        self.calls: list[Event] = []
        self._consts: dict[str, float] | None = None  # the module's NAME = constant bindings

    def leave_Module(self, node: cst.Module) -> None:
        if self._disabled:
            self.events = [e for e in self.events
                           if (e.region, e.scaler) not in self._disabled and (0, e.scaler) not in self._disabled]
        self.decide()

    def decide(self) -> None:  # pragma: no cover - every rule overrides it
        raise NotImplementedError

    # ---- context of the current node
    def _context(self):
        region = None
        loop = None
        anc: list[int] = []
        for p in self.ctx.ancestors():
            anc.append(id(p))
            if region is None and isinstance(p, h.LOOPS) and loop is None:
                loop = p
            if isinstance(p, h.SCOPES + (cst.Module,)):
                region = p
                break
        return region, loop, anc

    def _conds(self, region, loop) -> tuple[Cond, ...]:
        stack = self.ctx.parents
        out = []
        in_loop = True
        for i in range(len(stack) - 2, -1, -1):
            p, child = stack[i], stack[i + 1]
            if p is region:
                break
            if p is loop:
                in_loop = False
            if isinstance(p, (cst.If, cst.IfExp)) and (child is p.body or child is p.orelse):
                key, positive, eq = cond_key(p.test)
                truth = positive if child is p.body else not positive
                out.append(Cond(id(p), key, truth, accumulation_like(p.test), in_loop, short(code_of(p.test)),
                                p, child is p.body, eq, amp_related(p.test)))
        return tuple(out)

    def _exits(self, region) -> tuple[tuple[int, int | None], ...]:
        stack = self.ctx.parents
        out = []
        start = next((i for i in range(len(stack) - 1, -1, -1) if stack[i] is region), 0)
        for i in range(len(stack) - 2, start - 1, -1):
            block, child = stack[i], stack[i + 1]
            if not isinstance(block, (cst.IndentedBlock, cst.Module)):
                continue
            body = list(block.body)
            try:
                idx = next(k for k, s in enumerate(body) if s is child)
            except StopIteration:
                continue
            for stmt in body[idx:]:
                if not isinstance(stmt, cst.SimpleStatementLine):
                    continue
                kinds = {type(s) for s in stmt.body}  # the event's own line counts: `return S.step(o)`
                if kinds & {cst.Return, cst.Raise}:
                    out.append((id(block), None))
                    break
                if kinds & {cst.Continue, cst.Break}:
                    loop_id = None
                    for j in range(i, start - 1, -1):
                        if isinstance(stack[j], h.LOOPS):
                            loop_id = id(stack[j])
                            break
                    out.append((id(block), loop_id if loop_id is not None else id(block)))
                    break
        return tuple(out)

    def _add(self, kind: str, node: cst.CSTNode, scaler: str | None, arg: str | None,
             into: list[Event] | None = None, **extra) -> None:
        region, loop, anc = self._context()
        if kind in ("step", "unscale", "update"):
            rnd = self._round(node, region)
            extra["round"] = id(rnd)
            extra["data_loop"] = isinstance(rnd, h.LOOPS) and _data_loop(rnd)
        (self.events if into is None else into).append(Event(
            kind, node, scaler, arg, id(region), id(loop) if loop is not None else None, len(self.events),
            h.branch_path(self.ctx), self._conds(region, loop), frozenset(anc), self._exits(region),
            h.statement_of(self.ctx), dict(extra)))

    def _round(self, node: cst.CSTNode, region) -> cst.CSTNode:
        """The loop one pass of which is one round of optimizer steps (the training iteration),
        else the function: a loop over optimizers whose variable the call uses
        (``for opt in optimizers: scaler.step(opt)``) is part of the round, not the round."""
        used = {x.lower() for x in h.names_in(node.args[0].value)} if isinstance(node, cst.Call) and node.args else set()
        for p in self.ctx.ancestors():
            if p is region:
                break
            if isinstance(p, h.LOOPS):
                if isinstance(p, cst.For) and (used & _per_item_names(p) or self._runs_once(p)):
                    continue
                return p
        return region

    def _runs_once(self, loop: cst.For) -> bool:
        """``for _ in range(d_step_per_g_step):`` with ``d_step_per_g_step = 1`` at module level
        (Applio's discriminator steps per generator step): one pass, not a round of its own."""
        it = loop.iter
        if not (isinstance(it, cst.Call) and dotted_name(it.func) == "range" and len(it.args) == 1):
            return False
        n = it.args[0].value
        if isinstance(n, cst.Name):
            if self._consts is None:
                root = self.ctx.parents[0] if self.ctx.parents else None
                self._consts = values.module_constants(root, self.ctx.names) if isinstance(root, cst.Module) else {}
            return self._consts.get(n.value) == 1
        return h.number_value(n) == 1

    def _region_id(self) -> int:
        for p in self.ctx.ancestors():
            if isinstance(p, h.SCOPES + (cst.Module,)):
                return id(p)
        return 0

    # ---- scaled losses
    def _scaled_by(self, expr: cst.CSTNode) -> str | None:
        """The scaler whose ``scale()`` the expression went through ("?" for another
        ``*scale*`` call), else None."""
        region = self._region_id()
        generic = None
        for n in [expr, *h.walk(expr, enter_scopes=True)]:
            if isinstance(n, cst.Call):
                mc = h.method_call(n, "scale")
                if mc is not None and voc.is_scaler(self.ctx.names, mc[0]):
                    return dotted_name(mc[0]) or "?"
                fname = n.func.attr.value if isinstance(n.func, cst.Attribute) else \
                    n.func.value if isinstance(n.func, cst.Name) else ""
                if "scale" in fname.lower() and "unscale" not in fname.lower():
                    generic = "?"
            elif isinstance(n, (cst.Name, cst.Attribute)):
                d = dotted_name(n)
                if d is not None and (region, d) in self._scaled:
                    s = self._scaled[(region, d)]
                    if s != "?":
                        return s
                    generic = "?"
        return generic

    def _bind(self, targets, value) -> None:
        if isinstance(value, cst.Call) and voc.is_grad_scaler_name(self.ctx.names.qualified(value.func)):
            enabled = h.arg(value, None, "enabled")
            # GradScaler(1) / GradScaler(init_scale=1.0): a scale of 1 until update() changes it
            init = config.scaler_arg(self.ctx.names, value, "init_scale")
            region = self._region_id()
            for d in filter(None, map(dotted_name, targets)):
                # an attribute or a module-level name is one scaler for the file; a local, per function
                key = (0 if "." in d or self.ctx.scope_depth == 0 else region, d)
                if isinstance(enabled, cst.Name) and enabled.value == "False":
                    self._disabled.add(key)
                if init is not None and h.number_value(init) == 1.0:
                    self.unit_scale.add(key)
                else:
                    self.unit_scale.discard(key)
        region = self._region_id()
        s = self._scaled_by(value) if value is not None else None
        for t in targets:
            d = dotted_name(t)
            if d is None:
                continue
            if s is not None:
                self._scaled[(region, d)] = s
            else:
                self._scaled.pop((region, d), None)

    def leave_Assign(self, node: cst.Assign) -> None:
        self._bind([t.target for t in node.targets], node.value)

    def leave_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._bind([node.target], node.value)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None and isinstance(node.asname.name, (cst.Name, cst.Attribute)):
            s = self._scaled_by(node.item)
            if s is not None:
                self._scaled[(self._region_id(), dotted_name(node.asname.name) or "")] = s

    # ---- events
    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.names
        func = node.func
        if isinstance(func, cst.Attribute):
            recv, meth = func.value, func.attr.value
            if meth == "backward":
                self._backward(node, recv)
                return
            if meth in ("step", "unscale_", "update") and voc.is_scaler(names, recv):
                scaler = dotted_name(recv)
                if scaler is None:
                    return
                if meth == "update":
                    self._add("update", node, scaler, None)
                elif node.args and not node.args[0].star:
                    self._add("step" if meth == "step" else "unscale", node, scaler, code_of(node.args[0].value))
                return
            if meth == "step" and voc.is_optimizer(names, recv):
                self._add("plain_step", node, None, code_of(recv))
                return
            if meth == "zero_grad":
                self._add("zero_grad", node, None, code_of(recv))
                return
            if "unscale" in meth.lower():
                self._add("unscale_any", node, None, None)
                return
        elif isinstance(func, cst.Name) and "unscale" in func.value.lower():
            self._add("unscale_any", node, None, None)
            return
        fn = facts_of(self.ctx).calls.callee(node)
        if fn is not None:
            self._add("call", node, None, code_of(node.func), into=self.calls, callee=fn)
        self._clip(node)

    def _is_parameter(self, expr: cst.BaseExpression) -> cst.FunctionDef | None:
        """The enclosing function when ``loss`` is one of its parameters: its caller made it (and
        may have scaled it: ``self._backward(self.scaler.scale(loss))``)."""
        expr = strip_parens(expr)
        if not isinstance(expr, cst.Name):
            return None
        fn = next((p for p in self.ctx.ancestors() if isinstance(p, (cst.FunctionDef, cst.Lambda))), None)
        if not isinstance(fn, cst.FunctionDef):
            return None
        ps = fn.params
        if any(p.name.value == expr.value for p in (*ps.posonly_params, *ps.params, *ps.kwonly_params)):
            return fn
        return None

    def _backward(self, node: cst.Call, recv: cst.BaseExpression) -> None:
        if any(a.keyword is None for a in node.args):
            # `accelerator.backward(loss)`, `engine.backward(loss)`, `out.backward(grad)`; but
            # `features.backward(S.scale(grad))` is a scaled backward
            scaled = self._scaled_by(node.args[0].value)
            if scaled is not None and scaled != "?":
                self._add("scale_bw", node, scaled, code_of(node.args[0].value))
            return
        scaled = self._scaled_by(recv)
        if scaled is not None and scaled != "?":
            self._add("scale_bw", node, scaled, code_of(recv))
        elif scaled == "?":
            self._add("maybe_bw", node, None, code_of(recv))
        elif not _wrapper_receiver(recv):
            self._add("plain_bw", node, None, code_of(recv), receiver=recv, parameter=self._is_parameter(recv))

    def _clip(self, node: cst.Call) -> None:
        names = self.ctx.names
        q = names.qualified(node.func)
        what = None
        read = True
        if q in CLIP_FUNCS:
            read = False
            what = q.rsplit(".", 1)[-1] + "()"
        elif q in NORM_FUNCS and node.args and _mentions_grad(node.args[0].value):
            what = q + "()"
        elif isinstance(node.func, cst.Attribute):
            recv, meth = node.func.value, node.func.attr.value
            if meth == "clip_grad_norm_":
                made = (names.made_by(recv) or "").rsplit(".", 1)[-1]
                d = (dotted_name(recv) or "").rsplit(".", 1)[-1].lower()
                if made in _FSDP or (made == "" and any(w in d for w in ("model", "fsdp", "module"))
                                     and "accelerator" not in d):
                    what = f"{short(code_of(recv), 30)}.clip_grad_norm_()"
                    read = False
            elif meth.startswith("clip_grad") and _given_parameters(node) and \
                    not any(w in (dotted_name(recv) or "").lower() for w in ("accelerator", "fabric", "trainer")):
                # a clipper object or helper given the parameters (`self.clip_grad_norm(model.parameters())`);
                # accelerate/Lightning clip methods unscale first
                what = f"{short(code_of(node.func), 30)}()"
                read = False
            elif meth in MAGNITUDE_METHODS and _is_grad(recv):
                what = f"{short(code_of(recv), 30)}.{meth}()"
        if what is None:
            return
        st = h.statement_of(self.ctx)
        key = id(st[0]) if st is not None else id(node)
        if key in self._seen_statements:
            return  # one event per statement (`torch.norm(torch.stack([p.grad.norm() ...]))`)
        self._seen_statements.add(key)
        self._add("clip", node, None, what, tensor_read=read, stack=tuple(self.ctx.parents))

    # ---- queries for subclasses
    def in_region(self, e: Event, *kinds: str) -> list[Event]:
        return [o for o in self.events if o.region == e.region and o.kind in kinds]


def insertion_point(e: Event, q: Event) -> tuple[cst.CSTNode, tuple] | None:
    """Where a statement that must run once before ``e`` (a clip event with its ``stack``) and
    in the same pass as ``q`` goes: before ``e``'s statement line, or before the outermost loop
    around ``e`` that does not also hold ``q`` (``for p in params: p.grad.norm()``). Returns the
    statement and the (if id, branch) pairs around it, or None."""
    stack = e.extra.get("stack")
    if not stack or e.statement is None:
        return None
    start = next((i for i, n in enumerate(stack) if id(n) == e.region), None)
    if start is None:
        return None
    target = e.statement[0]
    for i in range(start + 1, len(stack)):
        if isinstance(stack[i], h.LOOPS) and id(stack[i]) not in q.anc:
            target = stack[i]
            break
    t = next((i for i, n in enumerate(stack) if n is target), None)
    if t is None or not isinstance(stack[t - 1], (cst.IndentedBlock, cst.Module)):
        return None
    branches = []
    for i in range(start, t):
        p, child = stack[i], stack[i + 1]
        if isinstance(p, cst.If):
            branches.append((id(p), "body" if child is p.body else "orelse"))
        elif isinstance(p, cst.Try):
            branches.append((id(p), "body" if child is p.body else f"handler{id(child)}"))
    return target, tuple(branches)


def _is_grad(expr: cst.BaseExpression) -> bool:
    """``p.grad`` or ``p.grad.data`` (optionally ``.detach()``ed)."""
    while True:
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "detach":
            expr = expr.func.value
            continue
        if isinstance(expr, cst.Attribute) and expr.attr.value == "data":
            expr = expr.value
            continue
        break
    return isinstance(expr, cst.Attribute) and expr.attr.value == "grad"


def _mentions_grad(expr: cst.BaseExpression) -> bool:
    return any(isinstance(n, cst.Attribute) and n.attr.value == "grad"
               for n in [expr, *h.walk(expr, enter_scopes=True)])
