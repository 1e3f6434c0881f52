"""The rule framework: a rule is one small class with visit_/leave_ methods.

Rules are instantiated once per file and run together in one traversal driven by the
engine. They read the shared :class:`Context` (ancestors, import aliases, settings) and
call :meth:`Rule.report`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Sequence, Union

import libcst as cst

from ampdoctor.diagnostics import RuleInfo, Severity
from ampdoctor.lint.names import Names

Replacement = Union[cst.CSTNode, cst.RemovalSentinel, cst.FlattenSentinel]


@dataclass(frozen=True)
class FixSpec:
    """A fix as CST edits: each original node is replaced by the given value.

    ``imports`` are modules that must be importable by their plain name afterwards
    (``import torch`` is added at the top of the file when it is missing).
    """

    changes: tuple[tuple[cst.CSTNode, Replacement], ...]
    safe: bool
    title: str | None = None
    imports: tuple[str, ...] = ()


@dataclass
class Report:
    rule: "Rule"
    node: cst.CSTNode
    message: str
    fix: FixSpec | None
    premises: tuple[cst.CSTNode, ...] = ()
    completed_by: tuple[str, ...] = ()


@dataclass
class Context:
    """What every rule can see about the file being linted."""

    path: str
    names: Names = field(default_factory=Names)
    text: str = ""  # the source being linted (what the module's code is)
    parents: list[cst.CSTNode] = field(default_factory=list)
    min_torch: tuple[int, ...] | None = None
    reports: list[Report] = field(default_factory=list)
    # number of enclosing def/class/lambda scopes of the node being visited
    scope_depth: int = 0
    # semantic.facts.FileFacts, built on first use by semantic.facts.facts_of
    facts: object = None

    def ancestors(self, skip_self: bool = True):
        """Ancestors from the innermost outwards (the current node excluded by default)."""
        stack = self.parents
        end = len(stack) - 1 if skip_self else len(stack)
        for i in range(end - 1, -1, -1):
            yield stack[i]


class Rule:
    code: ClassVar[str]
    name: ClassVar[str]
    severity: ClassVar[Severity]
    message: ClassVar[str]
    fix_title: ClassVar[str | None] = None
    # None, "safe", "unsafe" (an automatic fix) or "suggestion" (described, not applied)
    fix_availability: ClassVar[str | None] = None
    # byte strings of which at least one must occur in a file for the rule to run on it
    words: ClassVar[Sequence[bytes]] = ()
    # when set, at least one of these must occur as well (a second, AND-ed group)
    also: ClassVar[Sequence[bytes]] = ()
    default: ClassVar[bool] = True
    # runs in test files too (a defect rule whose finding is a bug whatever the test intends)
    in_tests: ClassVar[bool] = False
    summary: ClassVar[str] = ""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def report(self, node: cst.CSTNode, message: str | None = None, fix: FixSpec | None = None,
               premises: Sequence[cst.CSTNode] = (), completed_by: Sequence[str] = ()) -> None:
        """Report ``node``. ``premises``: the code the finding depends on; when none of it is ever
        run (an uncalled function), the finding is dropped with the project's unused code.
        ``completed_by``: source text that, in another Python file of the project, supplies what
        the finding says is missing; the project pass drops the finding when it finds one."""
        self.ctx.reports.append(Report(self, node, message or self.message, fix, tuple(premises),
                                       tuple(completed_by)))

    @classmethod
    def info(cls) -> RuleInfo:
        return RuleInfo(
            code=cls.code,
            name=cls.name,
            severity=cls.severity,
            summary=cls.summary or cls.message,
            fix=cls.fix_availability,
            default=cls.default,
        )
