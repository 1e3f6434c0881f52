"""Configuration: how a GradScaler is built and enabled (literal, by dtype, by a flag),
which dtypes a setting can take, the rewrites that enable a scaler for float16 only, and
``AutocastFlow``: which autocast regions feed a backward pass."""

from __future__ import annotations


import libcst as cst
from ampdoctor.lint import tree as _tree

from ampdoctor.lint import helpers as h
from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.semantic import source
from ampdoctor.lint.rule import Context
from ampdoctor.lint.semantic import vocabulary as voc

_EMPTY = cst.Module([])

# parameter positions of `enabled` when passed positionally
_ENABLED_POSITION = {
    "torch.cuda.amp.GradScaler": 4, "torch.cuda.amp.grad_scaler.GradScaler": 4,
    "torch.cpu.amp.GradScaler": 4, "torch.cpu.amp.grad_scaler.GradScaler": 4,
    "torch.amp.GradScaler": 5, "torch.amp.grad_scaler.GradScaler": 5,
    "torch.distributed.fsdp.ShardedGradScaler": 5,
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler": 5,
}

# words in a condition that make a branch "about precision"


code = source.code


def short(node: cst.CSTNode, limit: int = 60) -> str:
    return source.short(node, limit)


def is_grad_scaler_ctor(names: Names, node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Call) and voc.is_grad_scaler_name(names.qualified(node.func))


def scaler_enabled(names: Names, call: cst.Call) -> cst.BaseExpression | None:
    """The expression passed as ``enabled`` to a GradScaler constructor, or None."""
    q = names.qualified(call.func) or ""
    return h.arg(call, _ENABLED_POSITION.get(q), "enabled")


# GradScaler parameters after the device that torch.amp's (and ShardedGradScaler's) take first
_SCALER_PARAMS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")


def scaler_arg(names: Names, call: cst.Call, param: str) -> cst.BaseExpression | None:
    """A GradScaler constructor argument by parameter name, positional or keyword:
    ``torch.cuda.amp.GradScaler(init_scale, ...)``, ``torch.amp.GradScaler(device, init_scale, ...)``."""
    q = names.qualified(call.func) or ""
    offset = 0 if q.startswith(("torch.cuda.", "torch.cpu.")) else 1
    return h.arg(call, offset + _SCALER_PARAMS.index(param), param)


def is_literal(node: cst.CSTNode | None, value: bool) -> bool:
    return isinstance(node, cst.Name) and node.value == ("True" if value else "False")


def scaler_off(names: Names, call: cst.Call) -> bool:
    """A GradScaler created with a literal ``enabled=False``."""
    return is_literal(scaler_enabled(names, call), False)


def scaler_target(ctx: Context) -> str | None:
    """For ``S = GradScaler(...)`` (the current node being the call): ``S``; also for
    ``S = GradScaler() if amp else None``."""
    stack = list(ctx.parents)
    if len(stack) >= 3 and isinstance(stack[-2], cst.IfExp) and stack[-2].body is stack[-1]:
        stack = stack[:-1]
    if len(stack) >= 2 and isinstance(stack[-2], cst.Assign) and stack[-2].value is stack[-1] \
            and len(stack[-2].targets) == 1:
        return dotted_name(stack[-2].targets[0].target)
    if len(stack) >= 2 and isinstance(stack[-2], cst.AnnAssign) and stack[-2].value is stack[-1]:
        return dotted_name(stack[-2].target)
    return None


# -- dtypes in configuration values --------------------------------------------------



# -- "is this enabled when the run is bf16?" -------------------------------------------

_DTYPE_WORDS = {"float16", "half", "bfloat16", "float32", "float", "float64", "double"}


def literal_dtype(names: Names, node: cst.CSTNode) -> str | None:
    """The dtype a node spells out (``torch.bfloat16``, ``"bf16"``, an imported ``bfloat16``), but
    not a variable that merely holds one (``dtype = torch.bfloat16`` makes ``dtype`` an alias)."""
    if isinstance(node, cst.Name) and node.value not in _DTYPE_WORDS:
        return None
    return h.dtype_of(names, node)


def _collection(node: cst.CSTNode) -> list[cst.BaseExpression] | None:
    if isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        if any(isinstance(e, cst.StarredElement) for e in node.elements):
            return None
        return [e.value for e in node.elements]
    return None


def _values(names: Names, node: cst.CSTNode, positive: list) -> set[bool]:
    """Possible truth values of ``node`` in a bf16 run; ``positive`` collects the atoms that
    are true because the run is bf16."""
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        return {not v for v in _values(names, node.expression, [])}
    if isinstance(node, cst.IfExp):  # `dtype in (fp16, bf16) if use_amp else False`
        return _values(names, node.body, positive) | _values(names, node.orelse, positive)
    if isinstance(node, cst.BooleanOperation):
        left = _values(names, node.left, positive)
        right = _values(names, node.right, positive)
        if isinstance(node.operator, cst.And):
            return {a and b for a in left for b in right}
        return {a or b for a in left for b in right}
    if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
        comp = node.comparisons[0]
        op = comp.operator
        left, right = node.left, comp.comparator
        if isinstance(op, (cst.In, cst.NotIn)):
            items = _collection(right)
            if items is not None and literal_dtype(names, left) is None:
                dts = [h.dtype_of(names, i) for i in items]
                if "bfloat16" in dts:
                    v = isinstance(op, cst.In)
                elif all(d is not None for d in dts):
                    v = not isinstance(op, cst.In)
                else:
                    return {True, False}
                if v:
                    positive.append(node)
                return {v}
        elif isinstance(op, (cst.Equal, cst.NotEqual, cst.Is, cst.IsNot)):
            dl, dr = literal_dtype(names, left), literal_dtype(names, right)
            if (dl is None) != (dr is None):
                v = (dl or dr) == "bfloat16"
                if isinstance(op, (cst.NotEqual, cst.IsNot)):
                    v = not v
                if v:
                    positive.append(node)
                return {v}
        return {True, False}
    if voc.is_bf16_flag(node):
        positive.append(node)
        return {True}
    return {True, False}


def enables_for_bf16(names: Names, expr: cst.CSTNode) -> bool:
    """Whether an ``enabled=`` expression can be true *because* the run is bf16:
    ``dtype in (torch.float16, torch.bfloat16)``, ``args.fp16 or args.bf16``, ``use_amp and
    precision == "bf16"``. ``dtype == torch.float16`` and ``not use_bf16`` are not."""
    positive: list = []
    values = _values(names, expr, positive)
    return True in values and bool(positive)


def fp16_only_rewrite(names: Names, expr: cst.BaseExpression) -> cst.BaseExpression | None:
    """``X in (torch.float16, torch.bfloat16)`` -> ``(X == torch.float16)``: only for a plain
    membership test in a literal collection of float16/bfloat16 spellings."""
    if not (isinstance(expr, cst.Comparison) and len(expr.comparisons) == 1
            and isinstance(expr.comparisons[0].operator, cst.In)):
        return None
    items = _collection(expr.comparisons[0].comparator)
    if not items or literal_dtype(names, expr.left) is not None:
        return None
    dts = [h.dtype_of(names, i) for i in items]
    if any(d not in ("float16", "bfloat16") for d in dts) or "float16" not in dts:
        return None
    keep = [(el, d) for el, d in zip(expr.comparisons[0].comparator.elements, dts)  # type: ignore[attr-defined]
            if d == "float16"]
    lpar = expr.lpar or (cst.LeftParen(),)
    rpar = expr.rpar or (cst.RightParen(),)
    if len(keep) == 1:
        return cst.Comparison(left=expr.left.with_changes(lpar=expr.left.lpar, rpar=expr.left.rpar),
                              comparisons=[cst.ComparisonTarget(cst.Equal(), keep[0][0].value)],
                              lpar=lpar, rpar=rpar)
    comparator = expr.comparisons[0].comparator
    els = [el for el, _ in keep]
    els[-1] = els[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    new_coll = comparator.with_changes(elements=els)
    return expr.with_changes(comparisons=[expr.comparisons[0].with_changes(comparator=new_coll)])


# -- scopes and autocast regions ---------------------------------------------------------

def assigned_to(ctx: Context) -> str | None:
    """``NAME`` when the current call is assigned to it, maybe as one branch of a conditional
    expression (``ctx = nullcontext() if cpu else torch.autocast("cuda")``)."""
    stack = ctx.parents
    i = len(stack) - 2
    while i >= 0 and isinstance(stack[i], cst.IfExp) and stack[i + 1] is not stack[i].test:
        i -= 1
    if i >= 0 and isinstance(stack[i], cst.Assign) and len(stack[i].targets) == 1:
        return dotted_name(stack[i].targets[0].target)
    return None


def top_level_statement(ctx: Context) -> cst.CSTNode | None:
    """The module-level statement that holds the current node."""
    stack = ctx.parents
    if len(stack) >= 2 and isinstance(stack[0], cst.Module):
        return stack[1]
    return None


def precision_guard(ctx: Context) -> cst.BaseExpression | None:
    """The test of the innermost ``if`` (or conditional expression) about the precision whose
    true arm holds the current node: ``if opt.mixed_precision is True: scaler = GradScaler()``,
    ``GradScaler() if args.fp16 else None``. None elsewhere, in an ``else`` arm included."""
    stack = ctx.parents
    for i in range(len(stack) - 2, -1, -1):
        p, child = stack[i], stack[i + 1]
        if isinstance(p, (cst.If, cst.IfExp)) and child is not p.test:
            if child is p.body and precision_test(ctx.names, p.test):
                return p.test
            return None
    return None


def in_precision_branch(ctx: Context, words=voc.PRECISION_SUBSTRINGS) -> bool:
    """Inside an if/else or conditional expression whose test is about the precision."""
    stack = ctx.parents
    for i in range(len(stack) - 2, -1, -1):
        p, child = stack[i], stack[i + 1]
        if isinstance(p, (cst.If, cst.IfExp)) and child is not p.test:
            if test_mentions(ctx.names, p.test, words):
                return True
        if isinstance(p, cst.BooleanOperation) and child is p.right:
            if test_mentions(ctx.names, p.left, words):  # `fp16 and GradScaler()`
                return True
    return False


def precision_test(names: Names, expr: cst.CSTNode) -> bool:
    """An expression about the precision mode: `args.fp16`, `dtype == "float16"`, `scaler is None`,
    `self.use_amp`."""
    return test_mentions(names, expr) or any("amp" in voc.words(n) for n in h.names_in(expr))


def test_mentions(names: Names, test: cst.CSTNode, words=voc.PRECISION_SUBSTRINGS) -> bool:
    if h.mentions_dtype(names, test, "float16") or h.mentions_dtype(names, test, "bfloat16"):
        return True
    pieces = list(h.names_in(test))
    for n in h.walk(test, enter_scopes=True):
        s = h.string_value(n)
        if s is not None:
            pieces.append(s.lower())
    return any(w in p for p in pieces for w in words)


def bound_names(node: cst.CSTNode) -> set[str]:
    """Dotted names bound or mutated anywhere under ``node`` (assignments, loop targets,
    ``with ... as``, walrus, imports, defs)."""
    out: set[str] = set()

    def targets(t: cst.CSTNode) -> None:
        d = dotted_name(t)
        if d is not None:
            out.add(d)
        elif isinstance(t, (cst.Tuple, cst.List)):
            for e in t.elements:
                targets(e.value)
        elif isinstance(t, cst.StarredElement):
            targets(t.value)
        elif isinstance(t, cst.Subscript):
            targets(t.value)

    for n in [node, *h.walk(node, enter_scopes=False)]:
        if isinstance(n, cst.Assign):
            for t in n.targets:
                targets(t.target)
        elif isinstance(n, (cst.AnnAssign, cst.AugAssign)):
            targets(n.target)
        elif isinstance(n, (cst.For, cst.CompFor)):
            targets(n.target)
        elif isinstance(n, cst.WithItem) and n.asname is not None:
            targets(n.asname.name)
        elif isinstance(n, cst.NamedExpr):
            targets(n.target)
        elif isinstance(n, (cst.FunctionDef, cst.ClassDef)):
            out.add(n.name.value)
        elif isinstance(n, cst.Import):
            for a in n.names:
                out.add((a.asname.name.value if a.asname and isinstance(a.asname.name, cst.Name)
                         else (dotted_name(a.name) or "").split(".")[0]))
        elif isinstance(n, cst.ImportFrom) and not isinstance(n.names, cst.ImportStar):
            for a in n.names:
                out.add(a.asname.name.value if a.asname and isinstance(a.asname.name, cst.Name)
                        else (dotted_name(a.name) or ""))
    return out


def chains(node: cst.CSTNode) -> set[str]:
    """Every Name/Attribute chain read in an expression, with all of its prefixes."""
    out: set[str] = set()
    for n in [node, *h.walk(node, enter_scopes=True)]:
        d = dotted_name(n)
        if d is not None:
            parts = d.split(".")
            for i in range(1, len(parts) + 1):
                out.add(".".join(parts[:i]))
    return out


def depends_on(expr: cst.CSTNode, bound: set[str]) -> bool:
    """Whether ``expr`` reads a bound name (``self.cfg`` bound and ``self.cfg.amp`` read counts,
    since ``chains`` holds every prefix)."""
    return bool(chains(expr) & bound)


# -- which autocast blocks feed a backward pass -------------------------------------------

def scope_node(ctx: Context) -> cst.CSTNode:
    """The innermost def/class/lambda around the current node, else the module."""
    s = h.enclosing_scope(ctx)
    return s if s is not None else ctx.parents[0]


def _assigned(node: cst.CSTNode) -> list[cst.CSTNode]:
    if isinstance(node, cst.Assign):
        return [t.target for t in node.targets]
    if isinstance(node, (cst.AnnAssign, cst.AugAssign)):
        return [node.target]
    if isinstance(node, cst.NamedExpr):
        return [node.target]
    if isinstance(node, cst.For):
        return [node.target]
    return []


def _value(node: cst.CSTNode) -> cst.CSTNode | None:
    if isinstance(node, (cst.Assign, cst.AugAssign, cst.NamedExpr)):
        return node.value
    if isinstance(node, cst.AnnAssign):
        return node.value
    if isinstance(node, cst.For):
        return node.iter
    return None


def _names_of(targets: list[cst.CSTNode]) -> set[str]:
    out: set[str] = set()
    for t in targets:
        for n in [t, *h.walk(t, enter_scopes=True)]:
            if isinstance(n, cst.Subscript):
                continue
            d = dotted_name(n)
            if d is not None:
                out.add(d)
    return out


NO_GRAD = {"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad", "torch.autograd.grad_mode.no_grad",
           "torch.autograd.grad_mode.inference_mode", "torch.autograd.inference_mode"}


def _is_no_grad_with(names: Names, node: cst.CSTNode) -> bool:
    return isinstance(node, cst.With) and any(
        isinstance(i.item, cst.Call) and names.qualified(i.item.func) in NO_GRAD for i in node.items)


def _grad_assignments(names: Names, node: cst.CSTNode) -> list[cst.CSTNode]:
    """Targets assigned under ``node`` outside ``with torch.no_grad()`` blocks and nested defs."""
    out: list[cst.CSTNode] = []
    stack = list(reversed(_tree.children(node)))
    while stack:
        n = stack.pop()
        if isinstance(n, h.SCOPES) or _is_no_grad_with(names, n):
            continue
        out.extend(_assigned(n))
        stack.extend(reversed(_tree.children(n)))
    return out


class AutocastFlow:
    """Records ``with autocast(...)`` blocks (also ``ctx = autocast(...)`` then ``with ctx:``)
    and backward calls, and tells which blocks compute something a backward pass reads:
    the forward of a training step, as opposed to validation or sampling in the same function."""

    def __init__(self) -> None:
        self.blocks: list[tuple[cst.With, cst.CSTNode, cst.Call]] = []
        self.named: dict[str, cst.Call] = {}
        # `with NAME:` statements, resolved at the end (the def often comes before `ctx = ...`)
        self.pending: list[tuple[cst.With, cst.CSTNode, str]] = []
        self.backward: dict[int, list[cst.Call]] = {}

    def autocast(self, ctx: Context, call: cst.Call) -> None:
        """Call for each autocast call that the rule cares about."""
        stack = ctx.parents
        if len(stack) >= 3 and isinstance(stack[-2], cst.WithItem) and isinstance(stack[-3], cst.With) \
                and stack[-2].item is call:
            self.blocks.append((stack[-3], scope_node(ctx), call))
            return
        name = assigned_to(ctx)
        if name is not None:
            self.named[name] = call

    def with_statement(self, ctx: Context, node: cst.With) -> None:
        for item in node.items:
            d = dotted_name(item.item)
            if d is not None:
                self.pending.append((node, scope_node(ctx), d))

    def backward_call(self, ctx: Context, call: cst.Call) -> None:
        self.backward.setdefault(id(scope_node(ctx)), []).append(call)

    def feeding(self, names: Names) -> list[tuple[cst.With, cst.CSTNode, cst.Call]]:
        """The blocks whose results (computed with grad) reach a backward call of the same scope."""
        out = []
        blocks = self.blocks + [(w, sc, self.named[d]) for w, sc, d in self.pending if d in self.named]
        for block, scope, call in blocks:
            calls = self.backward.get(id(scope))
            if not calls:
                continue
            wanted = {id(c) for c in calls}
            tainted = _names_of(_grad_assignments(names, block.body))
            started = False
            hit = False
            for n in h.walk(scope):
                if n is block:
                    started = True
                    continue
                if not started:
                    continue
                value = _value(n)
                if value is not None and chains(value) & tainted:
                    tainted |= _names_of(_assigned(n))
                if id(n) in wanted and chains(n) & tainted:
                    hit = True
                    break
            if hit:
                out.append((block, scope, call))
        return out
