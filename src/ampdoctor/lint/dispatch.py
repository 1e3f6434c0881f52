"""Which rules run on a file (the word pre-filter) and the one traversal that runs them all."""

from __future__ import annotations

import re

from functools import lru_cache

import libcst as cst

from ampdoctor.lint import tree
from ampdoctor.lint.project import gated, test_path
from ampdoctor.lint.registry import rule_classes
from ampdoctor.lint.rule import Context, Rule


_SCOPE_NAMES = frozenset({"FunctionDef", "ClassDef", "Lambda"})


# -- rule selection -------------------------------------------------------------

@lru_cache(maxsize=64)
def _rules_for(enabled: frozenset[str]) -> tuple[type[Rule], ...]:
    return tuple(r for r in rule_classes() if r.code in enabled)


@lru_cache(maxsize=64)
def _word_table(enabled: frozenset[str]) -> tuple[tuple[bytes, ...], tuple[tuple[type[Rule], frozenset, frozenset], ...]]:
    rules = _rules_for(enabled)
    words = tuple(sorted({w for r in rules for w in (*r.words, *r.also)}))
    return words, tuple((r, frozenset(r.words), frozenset(r.also)) for r in rules)


def active_rules(enabled: frozenset[str], data: bytes, path: str = "") -> list[type[Rule]]:
    """The enabled rules whose words occur in the file: only those are run on it. Each word is
    looked for once with ``bytes.__contains__`` (a fast substring search), several times
    faster than one regular expression per rule."""
    words, table = _word_table(enabled)
    found = {w for w in words if w in data}
    rules = [cls for cls, first, second in table
             if (not first or not first.isdisjoint(found)) and (not second or not second.isdisjoint(found))]
    if rules and path and test_path(path):
        # tests set odd AMP configurations on purpose (clipping scaled gradients in both runs
        # they compare, a bare scaler, a device string): only the rules whose finding is a bug
        # whatever the intent (a call that raises, a check that is constant) run there
        rules = [cls for cls in rules if not gated(cls.code) or cls.in_tests]
    if rules and _other_framework(data):
        # Jittor, Paddle, MindSpore, ... code that looks like PyTorch: `masked_fill`, `.half()`
        # and `autocast` mean other things there; only the torch-API rules (deprecations) apply
        rules = [cls for cls in rules if not gated(cls.code)]
    return rules


_OTHER_FRAMEWORKS = (b"jittor", b"paddle", b"mindspore", b"oneflow", b"megengine", b"tensorflow", b"jax", b"mlx")
_TORCH_IMPORT = re.compile(rb"^\s*(?:import\s+torch\b|from\s+torch[\s.])", re.M)
_OTHER_IMPORT = re.compile(rb"^\s*(?:import|from)\s+(?:" + b"|".join(_OTHER_FRAMEWORKS) + rb")\b", re.M)


def _other_framework(data: bytes) -> bool:
    """The file imports another tensor framework and not torch (a substring search first: the
    regular expressions run only on files that name one)."""
    return (any(w in data for w in _OTHER_FRAMEWORKS) and _OTHER_IMPORT.search(data) is not None
            and _TORCH_IMPORT.search(data) is None)


@lru_cache(maxsize=None)
def _methods(cls: type[Rule]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    visits = tuple(sorted(n[6:] for n in dir(cls) if n.startswith("visit_") and callable(getattr(cls, n))))
    leaves = tuple(sorted(n[6:] for n in dir(cls) if n.startswith("leave_") and callable(getattr(cls, n))))
    return visits, leaves


# -- the single traversal ------------------------------------------------------------

class Dispatcher:
    """Runs every rule's visit_/leave_ methods in one walk and keeps the shared context."""

    def __init__(self, ctx: Context, rules: list[Rule]) -> None:
        self.ctx = ctx
        self.rules = rules
        self.failures: dict[str, str] = {}
        self._build()

    def _build(self) -> None:
        visit: dict[str, list] = {}
        leave: dict[str, list] = {}
        for rule in self.rules:
            if rule.code in self.failures:
                continue
            v, l = _methods(type(rule))
            for t in v:
                visit.setdefault(t, []).append((rule.code, getattr(rule, "visit_" + t)))
            for t in l:
                leave.setdefault(t, []).append((rule.code, getattr(rule, "leave_" + t)))
        self.visit_table = {k: tuple(v) for k, v in visit.items()}
        self.leave_table = {k: tuple(v) for k, v in leave.items()}

    def _fail(self, code: str, exc: BaseException) -> None:
        self.failures[code] = f"{type(exc).__name__}: {exc}"
        self._build()

    def walk(self, module: cst.Module) -> None:
        """Depth-first, in source order, over the meaningful nodes (see ``tree.py``)."""
        children = tree.children
        on_visit, on_leave = self.on_visit, self.on_leave
        stack: list = [(module, False)]
        pop, push = stack.pop, stack.append
        while stack:
            node, leaving = pop()
            if leaving:
                on_leave(node)
                continue
            on_visit(node)
            push((node, True))
            kids = children(node)
            for i in range(len(kids) - 1, -1, -1):
                push((kids[i], False))

    def on_visit(self, node: cst.CSTNode) -> bool:
        ctx = self.ctx
        ctx.parents.append(node)
        t = type(node).__name__
        if t == "Import":
            ctx.names.add_import(node, ctx.scope_depth == 0)  # type: ignore[arg-type]
        elif t == "ImportFrom":
            ctx.names.add_import_from(node, ctx.scope_depth == 0)  # type: ignore[arg-type]
        fns = self.visit_table.get(t)
        if fns:
            for code, fn in fns:
                try:
                    fn(node)
                except RecursionError:
                    raise
                except Exception as exc:  # a rule bug must not stop the other rules
                    self._fail(code, exc)
        if t in _SCOPE_NAMES:
            ctx.scope_depth += 1
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        ctx = self.ctx
        t = type(original_node).__name__
        if t in _SCOPE_NAMES:
            ctx.scope_depth -= 1
        fns = self.leave_table.get(t)
        if fns:
            for code, fn in fns:
                try:
                    fn(original_node)
                except RecursionError:
                    raise
                except Exception as exc:
                    self._fail(code, exc)
        if t == "Assign":
            ctx.names.add_assign([a.target for a in original_node.targets], original_node.value,  # type: ignore[attr-defined]
                                 _scope(ctx.parents))
        elif t == "AnnAssign" and original_node.value is not None:  # type: ignore[attr-defined]
            ctx.names.add_assign([original_node.target], original_node.value, _scope(ctx.parents))  # type: ignore[attr-defined]
        ctx.parents.pop()


def _scope(parents: list) -> int:
    """The innermost function (or the module) around the node being left."""
    for p in reversed(parents):
        if isinstance(p, cst.FunctionDef):
            return id(p)
    return 0
