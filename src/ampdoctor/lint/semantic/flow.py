"""Data flow inside one function: its nodes in source order and what each name is bound to.

One ``FunctionFlow`` per function (or module) body, built on first use and cached on the file's
facts (``flow_of(ctx, fn)``); nested defs, classes and lambdas are nodes of it but their bodies
are not entered. Two views of the same bindings:

- ``assigns``: dotted target -> ``Assignment`` (position of the statement), for "which
  assignments reach this use" questions (``reaching``), branch-aware;
- ``bindings``: ``Binding`` with the span after which it is visible (``binding_at``), for
  following a value back through local names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import libcst as cst

from ampdoctor.lint import helpers as h
from ampdoctor.lint import tree
from ampdoctor.lint.names import dotted_name
from ampdoctor.lint.rule import Context


@dataclass
class Assignment:
    order: int
    target: cst.BaseExpression
    value: cst.BaseExpression | None  # None for for-loop targets, with-targets, aug-assign...
    stmt: cst.CSTNode


@dataclass
class Binding:
    name: str
    value: cst.BaseExpression | None  # None for bindings that cannot be followed
    start: int  # preorder index of the statement
    end: int  # last preorder index inside it: the binding is visible after this
    aug: bool = False  # `x += y` style


@dataclass
class FunctionFlow:
    fn: cst.CSTNode
    order: dict[int, int] = field(default_factory=dict)  # id(node) -> preorder index
    end: dict[int, int] = field(default_factory=dict)  # id(node) -> last preorder index of its subtree
    parent: dict[int, cst.CSTNode] = field(default_factory=dict)
    nodes: list[cst.CSTNode] = field(default_factory=list)
    assigns: dict[str, list[Assignment]] = field(default_factory=dict)
    bindings: list[Binding] = field(default_factory=list)
    params: dict[str, cst.Param] = field(default_factory=dict)
    used_names: set[str] = field(default_factory=set)

    @classmethod
    def build(cls, fn: cst.CSTNode) -> "FunctionFlow":
        flow = cls(fn)
        if isinstance(fn, cst.FunctionDef):
            ps = fn.params
            for p in (*ps.posonly_params, *ps.params, *ps.kwonly_params, ps.star_arg, ps.star_kwarg):
                if isinstance(p, cst.Param):
                    flow.params[p.name.value] = p
            body = fn.body
            flow.parent[id(body)] = fn
        else:
            body = fn
        flow._number(body)
        for n in flow.nodes:
            t = type(n)
            if t is cst.Name:
                flow.used_names.add(n.value)
            elif t is cst.Assign:
                for a in n.targets:
                    flow._bind(a.target, n.value, n)
            elif t is cst.AnnAssign and n.value is not None:
                flow._bind(n.target, n.value, n)
            elif t is cst.AugAssign:
                flow._assign(n.target, None, n)
                d = dotted_name(n.target)
                if d is not None:
                    flow.bindings.append(Binding(d, n.value, flow.order[id(n)], flow.end[id(n)], aug=True))
            elif t is cst.For or t is cst.CompFor:
                flow._bind(n.target, None, n, header_only=True)
            elif t is cst.NamedExpr:
                flow._bind(n.target, n.value, n)
            elif t is cst.WithItem and n.asname is not None:
                flow._bind(n.asname.name, None, n)
            elif t is cst.FunctionDef and n is not fn:
                flow.used_names.add(n.name.value)
        return flow

    def _number(self, root: cst.CSTNode) -> None:
        stack: list[tuple[cst.CSTNode, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            if done:
                self.end[id(node)] = len(self.nodes) - 1
                continue
            self.order[id(node)] = len(self.nodes)
            self.nodes.append(node)
            stack.append((node, True))
            if node is not root and isinstance(node, h.SCOPES):
                continue
            for c in reversed(tree.children(node)):
                self.parent[id(c)] = node
                stack.append((c, False))

    def _bind(self, target: cst.CSTNode, value, stmt: cst.CSTNode, header_only: bool = False) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            # `q, k, v = a.float(), b.float(), c.float()`: each name gets its own element
            values = None
            if isinstance(value, (cst.Tuple, cst.List)) and len(value.elements) == len(target.elements) \
                    and not any(isinstance(e, cst.StarredElement) for e in (*value.elements, *target.elements)):
                values = [e.value for e in value.elements]
            for i, e in enumerate(target.elements):
                self._bind(e.value, values[i] if values else None, stmt, header_only)
            return
        if isinstance(target, cst.StarredElement):
            self._bind(target.value, None, stmt, header_only)
            return
        self._assign(target, value, stmt)
        d = dotted_name(target)
        if d is not None:
            end = self.order[id(stmt)] if header_only else self.end[id(stmt)]
            self.bindings.append(Binding(d, value, self.order[id(stmt)], end))

    def _assign(self, target: cst.CSTNode, value, stmt: cst.CSTNode) -> None:
        d = dotted_name(target)
        if d is not None:
            self.assigns.setdefault(d, []).append(Assignment(self.order[id(stmt)], target, value, stmt))

    # -- positions and structure ---------------------------------------------------------
    def pos(self, node: cst.CSTNode) -> int:
        return self.order.get(id(node), -1)

    def within(self, node: cst.CSTNode, outer: cst.CSTNode) -> bool:
        i = self.pos(node)
        return self.pos(outer) <= i <= self.end.get(id(outer), -2)

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        """From the parent of ``node`` up to the function itself."""
        p = self.parent.get(id(node))
        while p is not None:
            yield p
            if p is self.fn:
                return
            p = self.parent.get(id(p))

    def branches(self, node: cst.CSTNode) -> tuple[tuple[int, str], ...]:
        """The if/else, conditional-expression and try arms ``node`` sits in, outermost first."""
        out = []
        child = node
        p = self.parent.get(id(node))
        while p is not None and p is not self.fn:
            if isinstance(p, cst.If):
                out.append((id(p), "body" if child is p.body else "orelse"))
            elif isinstance(p, cst.IfExp):
                if child is p.body:
                    out.append((id(p), "body"))
                elif child is p.orelse:
                    out.append((id(p), "orelse"))
            elif isinstance(p, cst.Try):
                out.append((id(p), "body" if child is p.body else f"handler{id(child)}"))
            child = p
            p = self.parent.get(id(p))
        return tuple(reversed(out))

    # -- bindings ------------------------------------------------------------------------
    def derived(self, node: cst.CSTNode, seed: set[str] | None = None) -> tuple[int, set[str]]:
        """The names whose values come from ``node``: those bound by the statement holding it
        (``p = softmax(s)``), ``seed``, and every later binding computed from them
        (``p = dropout(p)``, ``w = p * m``); with the position after which they hold."""
        from ampdoctor.lint.semantic.values import expr_names

        tainted = set(seed or ())
        start = self.pos(node)
        for p in self.ancestors(node):
            if isinstance(p, (cst.Assign, cst.AugAssign, cst.AnnAssign, cst.NamedExpr)):
                start = self.end[id(p)]
                tainted |= {b.name for b in self.bindings if b.start == self.pos(p)}
                break
            if isinstance(p, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                break
        if tainted:
            for b in sorted(self.bindings, key=lambda b: b.end):
                if b.start > start and b.value is not None and tainted & expr_names(b.value):
                    tainted.add(b.name)
        return start, tainted


    def binding_at(self, name: str, at: int) -> Binding | None:
        """The most recent binding of ``name`` visible at preorder index ``at``."""
        best = None
        for b in self.bindings:
            if b.name == name and b.end < at and (best is None or b.end > best.end):
                best = b
        return best

    def assignments_before(self, name: str, node: cst.CSTNode) -> list[Assignment]:
        at = self.pos(node)
        return [a for a in self.assigns.get(name, ()) if a.order < at]

    def reaching(self, name: str, node: cst.CSTNode) -> list[Assignment]:
        """Assignments to ``name`` before ``node`` that may still hold: the last one on a path
        that is not exclusive with ``node`` plus any later ones in other branches."""
        before = self.assignments_before(name, node)
        br = self.branches(node)
        out = [a for a in before if not h.exclusive(self.branches(a.stmt), br)]
        if not out:
            return []
        last_unconditional = None
        for a in out:
            if all(b in br for b in self.branches(a.stmt)):  # on every path to node
                last_unconditional = a
        if last_unconditional is None:
            return out
        return [a for a in out if a.order >= last_unconditional.order]


def flow_of(ctx: Context, fn: cst.CSTNode) -> FunctionFlow:
    """The flow of ``fn`` (a def or the module), built once per file."""
    from ampdoctor.lint.semantic.facts import facts_of

    cache = facts_of(ctx).flows
    hit = cache.get(id(fn))
    if hit is None or hit.fn is not fn:
        hit = cache[id(fn)] = FunctionFlow.build(fn)
    return hit
