"""Lint one file: read -> pre-filter -> parse once -> one batched traversal -> fixes.

Everything here works on plain bytes and returns plain data, so it runs the same in the
main process and in pool workers, and the results can be cached.
"""

from __future__ import annotations

import ast
import difflib
import io
import itertools
import re
import sys
import threading
import tokenize
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

import libcst as cst
from libcst.metadata import CodePosition, CodeRange, MetadataWrapper, PositionProvider

from ampdoctor.diagnostics import Applicability, Diagnostic, Edit, Fix
from ampdoctor.lint import suppress, tree
from ampdoctor.lint.registry import (
    INTERNAL_ERROR,
    READ_ERROR,
    SYNTAX_ERROR,
    UNUSED_SUPPRESSION,
    all_infos,
    rule_classes,
)
from ampdoctor.lint.result import FileResult, Settings
from ampdoctor.lint.result import diag_at as _diag_at
from ampdoctor.lint.rule import Context, FixSpec, Report, Rule

MAX_FIX_ROUNDS = 10
_SCOPE_NAMES = frozenset({"FunctionDef", "ClassDef", "Lambda"})

# Deeply nested code exhausts Python's recursion limit in libcst (positions, code generation)
# and in rules. Such a file is linted again in a thread with a large stack and a higher limit.
DEEP_RECURSION_LIMIT = 60_000
DEEP_STACK_SIZE = 1 << 30  # address space only: pages the run does not touch are never used
_deep = threading.local()

# Python refuses more than 200 nested brackets ("too many nested parentheses"); libcst does
# not, and parses such nesting in time that grows much faster than the file. A file that deep
# is checked with Python's parser first.
MAX_NESTING = 200
_BRACKETS = bytes.maketrans(b"([{)]}", b"\x01\x01\x01\xff\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"()[]{}")


# -- rule selection -------------------------------------------------------------

@lru_cache(maxsize=64)
def _rules_for(enabled: frozenset[str]) -> tuple[type[Rule], ...]:
    return tuple(r for r in rule_classes() if r.code in enabled)


@lru_cache(maxsize=64)
def _word_table(enabled: frozenset[str]) -> tuple[tuple[bytes, ...], tuple[tuple[type[Rule], frozenset, frozenset], ...]]:
    rules = _rules_for(enabled)
    words = tuple(sorted({w for r in rules for w in (*r.words, *r.also)}))
    return words, tuple((r, frozenset(r.words), frozenset(r.also)) for r in rules)


def _active_rules(enabled: frozenset[str], data: bytes) -> list[type[Rule]]:
    """The enabled rules whose words occur in the file: only those are run on it. Each word is
    looked for once with ``bytes.__contains__`` (a fast substring search), several times
    faster than one regular expression per rule."""
    words, table = _word_table(enabled)
    found = {w for w in words if w in data}
    return [cls for cls, first, second in table
            if (not first or not first.isdisjoint(found)) and (not second or not second.isdisjoint(found))]


@lru_cache(maxsize=None)
def _methods(cls: type[Rule]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    visits = tuple(sorted(n[6:] for n in dir(cls) if n.startswith("visit_") and callable(getattr(cls, n))))
    leaves = tuple(sorted(n[6:] for n in dir(cls) if n.startswith("leave_") and callable(getattr(cls, n))))
    return visits, leaves


# -- the single traversal ------------------------------------------------------------

class _Dispatcher:
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
            ctx.names.add_assign([a.target for a in original_node.targets], original_node.value)  # type: ignore[attr-defined]
        elif t == "AnnAssign" and original_node.value is not None:  # type: ignore[attr-defined]
            ctx.names.add_assign([original_node.target], original_node.value)  # type: ignore[attr-defined]
        ctx.parents.pop()


# -- reading ------------------------------------------------------------------------

def decode(data: bytes) -> tuple[str, str]:
    """Decode Python source honouring a BOM and a PEP 263 coding cookie.

    Raises UnicodeDecodeError/SyntaxError/LookupError with a readable message.
    """
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding), encoding


def _max_nesting(data: bytes) -> int:
    """The deepest bracket nesting, counting brackets in strings and comments too (an upper bound)."""
    if data.count(b"(") + data.count(b"[") + data.count(b"{") < MAX_NESTING:
        return 0
    steps = memoryview(data.translate(_BRACKETS, _NOT_BRACKETS)).cast("b")
    return max(itertools.accumulate(steps), default=0)


def _python_syntax_error(text: str) -> tuple[int, int, str] | None:
    """Where and why Python's own parser rejects ``text``: (line, 1-based column, message), or None.

    libcst's error positions are often a line or more off (and a suppression comment on the
    wrong line then hides the error); Python's are the ones users see when they run the file.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compile(text, "<ampdoctor>", "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
        except SyntaxError as exc:
            if not exc.lineno:
                return None
            line = max(1, min(exc.lineno, text.count("\n") + 1))
            return line, max(1, exc.offset or 1), f"{type(exc).__name__}: {exc.msg}"
        except (RecursionError, MemoryError):
            return 1, 1, "the file is nested too deeply to be parsed"
        except (ValueError, TypeError):
            return None
    return None




# -- fixes --------------------------------------------------------------------------

class _Apply(cst.CSTTransformer):
    def __init__(self, replacements: dict[int, object]) -> None:
        super().__init__()
        self.replacements = replacements

    def on_leave(self, original_node, updated_node):  # type: ignore[override]
        rep = self.replacements.get(id(original_node))
        return updated_node if rep is None else rep


def _has_import(module: cst.Module, name: str) -> bool:
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for s in stmt.body:
                if isinstance(s, cst.Import):
                    for a in s.names:
                        bound = a.asname.name.value if a.asname and isinstance(a.asname.name, cst.Name) \
                            else (cst.helpers.get_full_name_for_node(a.name) or "").split(".")[0]
                        if bound == name:
                            return True
    return False


def _add_import(module: cst.Module, name: str) -> cst.Module:
    """Insert ``import NAME`` after the module docstring, __future__ imports and leading imports."""
    body = list(module.body)
    idx = 0
    if body and isinstance(body[0], cst.SimpleStatementLine) and body[0].body and \
            isinstance(body[0].body[0], cst.Expr) and isinstance(body[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        idx = 1
    while idx < len(body) and isinstance(body[idx], cst.SimpleStatementLine) and \
            all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in body[idx].body):
        idx += 1
    body.insert(idx, cst.parse_statement(f"import {name}\n", config=module.config_for_parsing))
    return module.with_changes(body=body)


def apply_fixes(module: cst.Module, fixes: Iterable[FixSpec]) -> str:
    replacements: dict[int, object] = {}
    imports: set[str] = set()
    for f in fixes:
        for node, rep in f.changes:
            replacements[id(node)] = rep
        imports.update(f.imports)
    new = module.visit(_Apply(replacements)) if replacements else module
    for name in sorted(imports):
        if not _has_import(new, name):
            new = _add_import(new, name)
    return new.code


# Python's line breaks (str.splitlines also splits at form feeds, \x1c-\x1e, \x85, \u2028, ...,
# which are not line breaks in source code, so positions after them would be lines too far)
_NEWLINE = re.compile(r"\r\n|\r|\n")
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


def _keep_final_cr(old: str, new: str) -> str:
    """libcst drops the line break at the end of a file whose lines end with a lone CR; put it back."""
    if old.endswith("\r") and new and not new.endswith(("\r", "\n")):
        return new + "\r"
    return new


def text_edits(old: str, new: str) -> tuple[Edit, ...]:
    """Minimal edits turning ``old`` into ``new``: changed line blocks, trimmed to the characters."""
    a = _LINE.findall(old)
    b = _LINE.findall(new)
    # only the lines between the common head and tail are compared: the matcher is quadratic in
    # repeated lines (blank lines, comments), and a fix is local
    head = 0
    while head < len(a) and head < len(b) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < len(a) - head and tail < len(b) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    matcher = difflib.SequenceMatcher(None, a[head:len(a) - tail], b[head:len(b) - tail], autojunk=False)
    edits = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        i1, i2, j1, j2 = i1 + head, i2 + head, j1 + head, j2 + head
        old_text = "".join(a[i1:i2])
        new_text = "".join(b[j1:j2])
        p = 0
        while p < min(len(old_text), len(new_text)) and old_text[p] == new_text[p]:
            p += 1
        s = 0
        while s < min(len(old_text), len(new_text)) - p and old_text[-1 - s] == new_text[-1 - s]:
            s += 1
        start = _advance(i1 + 1, 1, old_text[:p])
        end = _advance(i1 + 1, 1, old_text[: len(old_text) - s])
        edits.append(Edit(start[0], start[1], end[0], end[1], new_text[p: len(new_text) - s]))
    return tuple(edits)


def _advance(line: int, col: int, text: str) -> tuple[int, int]:
    ends = [m.end() for m in _NEWLINE.finditer(text)]
    if ends:
        return line + len(ends), len(text) - ends[-1] + 1
    return line, col + len(text)


# -- linting ------------------------------------------------------------------------------

@dataclass
class _Pass:
    module: cst.Module | None
    diagnostics: list[Diagnostic]
    # (diagnostic, its fix, the span the fix touches)
    fixable: list[tuple[Diagnostic, FixSpec, tuple[int, int, int, int]]]


def _parse(text: str) -> cst.Module:
    """Parse without libcst's per-node validation.

    Every node's ``__post_init__`` re-validates what the parser has just produced, which costs
    about a quarter of the parse (libcst's own source notes it). Nodes that rules and fixes
    build later are validated as usual."""
    base = cst.CSTNode
    saved = base.__dict__.get("__post_init__")
    if saved is None:  # pragma: no cover - a libcst without the hook
        return cst.parse_module(text)
    base.__post_init__ = _no_validation  # type: ignore[method-assign]
    try:
        return cst.parse_module(text)
    finally:
        base.__post_init__ = saved  # type: ignore[method-assign]


def _no_validation(self) -> None:
    return None


def _lint_text(path: str, text: str, settings: Settings, errors: list[Diagnostic]) -> _Pass:
    infos = all_infos()
    try:
        module = _parse(text)
    except cst.ParserSyntaxError as exc:
        python = _python_syntax_error(text)
        if python is not None:
            errors.append(_diag_at(path, SYNTAX_ERROR, *python))
            return _Pass(None, [], [])
        msg = str(exc).splitlines()[0] if str(exc) else "invalid syntax"
        errors.append(_diag_at(path, SYNTAX_ERROR, exc.raw_line, exc.raw_column + 1, f"SyntaxError: {exc.message}"
                               if getattr(exc, "message", None) else msg))
        return _Pass(None, [], [])
    except RecursionError:
        if not getattr(_deep, "on", False):
            raise  # lint_bytes tries again with a deeper stack
        errors.append(_diag_at(path, SYNTAX_ERROR, 1, 1, "the file is nested too deeply to be parsed"))
        return _Pass(None, [], [])

    ctx = Context(path=path, min_torch=settings.min_torch)
    rules = [cls(ctx) for cls in _active_rules(settings.enabled, text.encode("utf-8", "surrogatepass"))]
    dispatcher = _Dispatcher(ctx, rules)
    try:
        dispatcher.walk(module)
    except RecursionError:
        if not getattr(_deep, "on", False):
            raise  # lint_bytes tries again with a deeper stack
        errors.append(_diag_at(path, INTERNAL_ERROR, 1, 1, "the file is nested too deeply to be checked"))
        return _Pass(module, [], [])
    for code, err in sorted(dispatcher.failures.items()):
        errors.append(_diag_at(path, INTERNAL_ERROR, 1, 1, f"rule {code} failed on this file ({err}); "
                               "the rest of the file was checked without it"))

    reports: list[Report] = [r for r in ctx.reports if r.rule.code not in dispatcher.failures]
    if not reports:
        return _Pass(module, [], [])
    targets = [r.node for r in reports] + [n for r in reports if r.fix is not None for n, _ in r.fix.changes]
    positions = _positions(module, text, targets)
    diagnostics: list[Diagnostic] = []
    fixable: list[tuple[Diagnostic, FixSpec, tuple[int, int, int, int]]] = []
    seen: set[tuple] = set()
    for rep in reports:
        rng = positions.get(rep.node)
        if rng is None:
            continue
        key = (rep.rule.code, rng.start.line, rng.start.column, rep.message)
        if key in seen:
            continue
        seen.add(key)
        info = infos[rep.rule.code]
        fix = None
        if rep.fix is not None and settings.want_edits:
            new_code = _keep_final_cr(text, apply_fixes(module, [rep.fix]))
            edits = text_edits(text, new_code)
            if edits:
                fix = Fix(rep.fix.title or rep.rule.fix_title or "Apply fix",
                          Applicability.SAFE if rep.fix.safe else Applicability.UNSAFE, edits)
        diag = Diagnostic(
            path=path, line=rng.start.line, column=rng.start.column + 1, code=rep.rule.code,
            end_line=rng.end.line, end_column=rng.end.column + 1, name=info.name,
            severity=info.severity, message=_one_line(rep.message),
            fix_title=(rep.fix.title or rep.rule.fix_title) if rep.fix else
            (rep.rule.fix_title if rep.rule.fix_availability == "suggestion" else None), fix=fix,
        )
        diagnostics.append(diag)
        if rep.fix is not None:
            spans = []
            for node, _ in rep.fix.changes:
                r = positions.get(node)
                if r is not None:
                    spans.append((r.start.line, r.start.column, r.end.line, r.end.column))
            if spans:
                lo = min(s[:2] for s in spans)
                hi = max(s[2:] for s in spans)
                fixable.append((diag, rep.fix, (lo[0], lo[1], hi[0], hi[1])))
    return _Pass(module, diagnostics, fixable)


def _positions(module: cst.Module, text: str, nodes: list[cst.CSTNode]) -> dict[cst.CSTNode, CodeRange]:
    """Where ``nodes`` are in the source.

    libcst computes positions by generating the code of the whole module, which costs twice
    the parse. Only the top-level statements that hold the nodes are generated here, each as a
    module of its own, and placed by finding their code (an exact part of the source: a parse
    round-trips) in the text. When that is ambiguous, the whole module is generated as usual."""
    left = {id(n) for n in nodes}
    holders: list[cst.BaseStatement] = []
    for stmt in module.body:
        if not left:
            break
        hit = id(stmt) in left
        left.discard(id(stmt))
        for n in tree.walk(stmt):
            if id(n) in left:
                left.discard(id(n))
                hit = True
        if hit:
            holders.append(stmt)
    whole = None
    if not left:
        whole = {}
        for stmt in holders:
            single = module.with_changes(header=(), body=(stmt,), footer=())
            code = single.code
            start = text.find(code)
            if not code or start < 0 or text.find(code, start + 1) >= 0:
                whole = None
                break
            shift = len(_NEWLINE.findall(text, 0, start))
            for node, rng in MetadataWrapper(single, unsafe_skip_copy=True).resolve(PositionProvider).items():
                whole[node] = rng if not shift else CodeRange(CodePosition(rng.start.line + shift, rng.start.column),
                                                             CodePosition(rng.end.line + shift, rng.end.column))
    if whole is None:
        return dict(MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider))
    return whole


def _apply_suppressions(path: str, text: str | None, data: bytes, diagnostics: list[Diagnostic],
                        settings: Settings) -> list[Diagnostic]:
    if text is None or not suppress.QUICK.search(data):
        return diagnostics
    sups = suppress.parse(text)
    if not sups:
        return diagnostics
    kept = []
    for d in diagnostics:
        hit = False
        for s in sups:
            if s.file_level or s.line in (d.line, d.end_line):
                entry = s.matches(d.code)
                if entry is not None:
                    s.used.add(entry)
                    hit = True
        if not hit:
            kept.append(d)
    if UNUSED_SUPPRESSION.code in settings.enabled:
        known = all_infos()
        for s in sups:
            if s.codes is None:
                if not s.used:
                    kept.append(_diag_at(path, UNUSED_SUPPRESSION, s.line, s.column,
                                         "unused suppression: nothing is reported here",
                                         s.line, s.end_column))
                continue
            for c in s.codes:
                if c in s.used:
                    continue
                matching = [k for k in known if k.startswith(c)]
                if not matching:
                    msg = f"unused suppression: unknown code {c}"
                elif not any(k in settings.enabled for k in matching):
                    continue  # the code is not enabled in this run, so it may well be needed
                else:
                    msg = f"unused suppression: {c} is not reported here"
                kept.append(_diag_at(path, UNUSED_SUPPRESSION, s.line, s.column, msg, s.line, s.end_column))
    return kept


def _select_non_overlapping(fixable, allow_unsafe: bool) -> list[FixSpec]:
    chosen: list[FixSpec] = []
    taken: list[tuple[int, int, int, int]] = []
    for _, spec, span in sorted(fixable, key=lambda f: f[2]):
        if not spec.safe and not allow_unsafe:
            continue
        lo, hi = span[:2], span[2:]
        if any(not (hi <= t[:2] or lo >= t[2:]) for t in taken):
            continue
        chosen.append(spec)
        taken.append(span)
    return chosen


def _one_line(message: str) -> str:
    """A diagnostic is one line (concise and github output rely on it), whatever code a rule quotes."""
    return re.sub(r"\s*[\r\n]+\s*", " ", message) if "\n" in message or "\r" in message else message


def lint_bytes(path: str, data: bytes, settings: Settings) -> FileResult:
    """Lint one file's content. Never raises for any input."""
    result = FileResult(path)
    try:
        return _lint_bytes(path, data, settings, result)
    except RecursionError:
        if getattr(_deep, "on", False):
            return FileResult(path, [_diag_at(path, INTERNAL_ERROR, 1, 1, "the file is nested too deeply to be checked")])
    except Exception as exc:  # the last line of defence: one file never stops a run
        result.diagnostics = [_diag_at(path, INTERNAL_ERROR, 1, 1, f"internal error ({type(exc).__name__}: {exc})")]
        result.fixed = None
        return result
    return _lint_deep(path, data, settings)


def _lint_deep(path: str, data: bytes, settings: Settings) -> FileResult:
    """``lint_bytes`` again in a thread with a large stack and a high recursion limit (deep nesting)."""
    box: list[FileResult] = []

    def work() -> None:
        _deep.on = True
        box.append(lint_bytes(path, data, settings))

    # nesting that Python itself cannot parse is a syntax error, whatever libcst manages
    try:
        python = _python_syntax_error(decode(data)[0])
    except (UnicodeDecodeError, SyntaxError, LookupError):
        python = None
    if python is not None:
        return FileResult(path, _filter_engine([_diag_at(path, SYNTAX_ERROR, *python)], settings.enabled))
    too_deep = FileResult(path, [_diag_at(path, INTERNAL_ERROR, 1, 1, "the file is nested too deeply to be checked")])
    old_limit = sys.getrecursionlimit()
    try:
        old_size = threading.stack_size(DEEP_STACK_SIZE)
    except (ValueError, RuntimeError):  # pragma: no cover - a platform without settable stacks
        return too_deep
    try:
        thread = threading.Thread(target=work, name="ampdoctor-deep", daemon=True)
        sys.setrecursionlimit(max(old_limit, DEEP_RECURSION_LIMIT))
        thread.start()
        thread.join()
    except RuntimeError:  # no thread (a memory limit): the file is reported, the run goes on
        return too_deep
    finally:
        threading.stack_size(old_size)
        sys.setrecursionlimit(old_limit)
    return box[0] if box else too_deep


def _lint_bytes(path: str, data: bytes, settings: Settings, result: FileResult) -> FileResult:
    enabled = settings.enabled
    has_sup = UNUSED_SUPPRESSION.code in enabled and suppress.QUICK.search(data) is not None
    if not _active_rules(enabled, data) and not has_sup:
        result.skipped = True
        return result
    errors: list[Diagnostic] = []
    try:
        text, encoding = decode(data)
    except (UnicodeDecodeError, SyntaxError, LookupError) as exc:
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        errors.append(_diag_at(path, READ_ERROR, 1, 1, f"cannot decode the file: {reason}"))
        result.diagnostics = [d for d in errors if d.code in enabled or d.code == READ_ERROR.code]
        return result
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        errors.append(_diag_at(path, SYNTAX_ERROR, line, 1, "SyntaxError: source code cannot contain null bytes"))
        result.diagnostics = _filter_engine(errors, enabled)
        return result

    current = text
    too_deep = _python_syntax_error(text) if _max_nesting(data) >= MAX_NESTING else None
    if too_deep is not None:
        errors.append(_diag_at(path, SYNTAX_ERROR, *too_deep))
        passed = _Pass(None, [], [])
    else:
        passed = _lint_text(path, current, settings, errors)
    if settings.fix and passed.module is not None:
        allow_unsafe = settings.fix == "unsafe"
        first, first_errors = passed, list(errors)
        for _ in range(MAX_FIX_ROUNDS):
            reported = {id(d) for d in _apply_suppressions(path, current, data, passed.diagnostics, settings)}
            candidates = [f for f in passed.fixable if id(f[0]) in reported]
            chosen = _select_non_overlapping(candidates, allow_unsafe)
            if not chosen:
                break
            new_text = _keep_final_cr(current, apply_fixes(passed.module, chosen))
            if new_text == current:
                break
            probe_errors: list[Diagnostic] = []
            probe = _lint_text(path, new_text, settings, probe_errors)
            if probe.module is None:
                errors.append(_diag_at(path, INTERNAL_ERROR, 1, 1,
                                       "a fix produced code that does not parse; the file was left as it was"))
                break
            current, passed = new_text, probe
            errors = [e for e in errors if e.code != INTERNAL_ERROR.code] + probe_errors
            result.fixes_applied += len(chosen)
        else:
            # still fixing after MAX_FIX_ROUNDS: a fix brings back what it fixed and would be
            # applied over and over, so none is applied
            current, passed, result.fixes_applied = text, first, 0
            errors = first_errors + [_diag_at(path, INTERNAL_ERROR, 1, 1,
                                              f"fixes did not converge after {MAX_FIX_ROUNDS} rounds; "
                                              "the file was left as it was")]
        if current != text:
            result.fixed = current.encode(encoding)
    diags = passed.diagnostics + _filter_engine(errors, enabled)
    result.diagnostics = sorted(_apply_suppressions(path, current, result.fixed or data, diags, settings))
    return result


def _filter_engine(errors: list[Diagnostic], enabled: frozenset[str]) -> list[Diagnostic]:
    # internal errors are always reported: hiding them would hide unchecked code
    return [d for d in errors if d.code in enabled or d.code == INTERNAL_ERROR.code]
