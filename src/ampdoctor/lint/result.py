"""Plain results of linting one file (no libcst, so cached runs never import it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ampdoctor.diagnostics import Diagnostic
from ampdoctor.lint.registry import INTERNAL_ERROR


@dataclass(frozen=True)
class Settings:
    """Per-file settings: which codes run and what to do with fixes."""

    enabled: frozenset[str]
    min_torch: tuple[int, ...] | None = None
    fix: str | None = None  # None, "safe" or "unsafe": apply fixes of that safety and below
    want_edits: bool = True  # compute the text edits of each available fix


@dataclass
class FileResult:
    path: str
    diagnostics: list[Diagnostic] = field(default_factory=list)
    fixed: bytes | None = None  # new file content when fixes were applied
    fixes_applied: int = 0
    applied: list[Diagnostic] = field(default_factory=list)  # the diagnostics whose fixes were applied
    skipped: bool = False  # the pre-filter found nothing to look at

    @property
    def internal_error(self) -> bool:
        return any(d.code == INTERNAL_ERROR.code for d in self.diagnostics)


def diag_at(path: str, info, line: int, column: int, message: str,
            end_line: int | None = None, end_column: int | None = None) -> Diagnostic:
    return Diagnostic(
        path=path, line=line, column=column, code=info.code,
        end_line=end_line if end_line is not None else line,
        end_column=end_column if end_column is not None else column,
        name=info.name, severity=info.severity, message=message,
    )
