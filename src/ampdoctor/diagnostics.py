"""Plain value types shared by the linter, the reporters and the CLI (stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return {"error": 3, "warning": 2, "info": 1}[self.value]


class Applicability(str, Enum):
    SAFE = "safe"
    UNSAFE = "unsafe"


@dataclass(frozen=True)
class Edit:
    """Replace the text between two 1-based (line, column) positions with ``content``."""

    line: int
    column: int
    end_line: int
    end_column: int
    content: str

    def to_dict(self) -> dict:
        return {
            "content": self.content,
            "location": {"line": self.line, "column": self.column},
            "end_location": {"line": self.end_line, "column": self.end_column},
        }


@dataclass(frozen=True)
class Fix:
    title: str
    applicability: Applicability
    edits: tuple[Edit, ...] = ()

    def to_dict(self) -> dict:
        return {
            "title": self.title,
            "applicability": self.applicability.value,
            "edits": [e.to_dict() for e in self.edits],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Fix":
        return cls(
            title=d["title"],
            applicability=Applicability(d["applicability"]),
            edits=tuple(
                Edit(
                    e["location"]["line"],
                    e["location"]["column"],
                    e["end_location"]["line"],
                    e["end_location"]["column"],
                    e["content"],
                )
                for e in d["edits"]
            ),
        )


@dataclass(frozen=True, order=True)
class Diagnostic:
    """One finding. Lines and columns are 1-based; ``end_column`` is exclusive."""

    path: str
    line: int
    column: int
    code: str
    end_line: int = field(compare=False)
    end_column: int = field(compare=False)
    name: str = field(compare=False)
    severity: Severity = field(compare=False)
    message: str = field(compare=False)
    fix_title: str | None = field(default=None, compare=False)
    fix: Fix | None = field(default=None, compare=False)
    # why it matters and what to do (``message`` is the short what, for the location line)
    explanation: str | None = field(default=None, compare=False)
    # lines of the same file whose code the finding depends on (the resume code that makes a lost
    # loss scale matter): when none of it can run, the project pass drops the finding
    premises: tuple[int, ...] = field(default=(), compare=False)
    # source text that, found in another Python file of the project, completes what the finding
    # says is missing (`.scaler.update(` for a step whose update a training script calls)
    completed_by: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict:
        return {
            "code": self.code,
            "name": self.name,
            "severity": self.severity.value,
            "message": self.message,
            "explanation": self.explanation,
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "fix_title": self.fix_title,
            "fix": self.fix.to_dict() if self.fix else None,
        }

    def to_cache_dict(self) -> dict:
        """``to_dict`` plus what only the project pass needs (not part of the JSON output);
        ``from_dict`` reads both."""
        return {**self.to_dict(), "premises": list(self.premises), "completed_by": list(self.completed_by)}

    @classmethod
    def from_dict(cls, d: dict) -> "Diagnostic":
        return cls(
            path=d["path"],
            line=d["line"],
            column=d["column"],
            code=d["code"],
            end_line=d["end_line"],
            end_column=d["end_column"],
            name=d["name"],
            severity=Severity(d["severity"]),
            message=d["message"],
            fix_title=d.get("fix_title"),
            fix=Fix.from_dict(d["fix"]) if d.get("fix") else None,
            explanation=d.get("explanation"),
            premises=tuple(int(x) for x in d.get("premises", ())),
            completed_by=tuple(str(x) for x in d.get("completed_by", ())),
        )


def fix_counts(diags) -> tuple[int, int]:
    """How many of the diagnostics have a safe fix, and how many an unsafe one."""
    safe = unsafe = 0
    for d in diags:
        if d.fix is not None:
            if d.fix.applicability is Applicability.SAFE:
                safe += 1
            else:
                unsafe += 1
    return safe, unsafe


@dataclass(frozen=True)
class RuleInfo:
    """What the CLI and reporters need to know about a rule, without importing libcst."""

    code: str
    name: str
    severity: Severity
    summary: str
    fix: str | None  # None, "safe", "unsafe" or "suggestion"
    default: bool


class AmpdoctorError(Exception):
    """An error caused by the user's input (flags, config, paths): one line, exit code 2."""
