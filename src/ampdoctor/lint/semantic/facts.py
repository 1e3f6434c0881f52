"""``FileFacts``: the semantic facts of one file, each built on first use and kept for the file."""

from __future__ import annotations

import libcst as cst

from ampdoctor.lint.rule import Context


class FileFacts:
    def __init__(self, module: cst.Module) -> None:
        self.module = module
        self._calls = None
        self._evidence = None
        self._assigned: dict[str, list[cst.BaseExpression]] | None = None
        self.flows: dict = {}  # id(def or module) -> semantic.flow.FunctionFlow

    @property
    def calls(self):
        if self._calls is None:
            from ampdoctor.lint.semantic.calls import CallGraph

            self._calls = CallGraph(self.module)
        return self._calls

    @property
    def evidence(self):
        if self._evidence is None:
            from ampdoctor.lint.semantic.evidence import Evidence

            self._evidence = Evidence(self.module, self.calls)
        return self._evidence


    def assigned_values(self, target: str) -> list[cst.BaseExpression]:
        """Every value the file assigns to the dotted ``target`` (``self.precision``,
        ``AMP_DTYPE``), in any scope: what a setting read elsewhere in the file can hold."""
        if self._assigned is None:
            from ampdoctor.lint import helpers as h
            from ampdoctor.lint.names import dotted_name

            index: dict[str, list[cst.BaseExpression]] = {}
            for n in h.walk(self.module, enter_scopes=True):
                if isinstance(n, cst.Assign):
                    for t in n.targets:
                        d = dotted_name(t.target)
                        if d is not None:
                            index.setdefault(d, []).append(n.value)
                elif isinstance(n, cst.AnnAssign) and n.value is not None:
                    d = dotted_name(n.target)
                    if d is not None:
                        index.setdefault(d, []).append(n.value)
            self._assigned = index
        return self._assigned.get(target, [])


def facts_of(ctx: Context) -> FileFacts:
    """The facts of the file ``ctx`` is linting (the module is the root of ``ctx.parents``)."""
    facts = ctx.facts
    if facts is None:
        facts = ctx.facts = FileFacts(ctx.parents[0])  # type: ignore[arg-type]
    return facts
