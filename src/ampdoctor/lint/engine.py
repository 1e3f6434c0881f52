"""Lint one file: read -> pre-filter -> parse once -> one batched traversal -> fixes.

Everything here works on plain bytes and returns plain data, so it runs the same in the
main process and in pool workers, and the results can be cached.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import threading
from dataclasses import dataclass

import libcst as cst

from ampdoctor.diagnostics import Applicability, Diagnostic, Fix
from ampdoctor.lint import messages, suppress
from ampdoctor.lint.registry import INTERNAL_ERROR, READ_ERROR, SYNTAX_ERROR, UNUSED_SUPPRESSION, all_infos
from ampdoctor.lint.result import FileResult, Settings
from ampdoctor.lint.result import diag_at as _diag_at
from ampdoctor.lint.rule import Context, FixSpec, Report
from ampdoctor.lint.decoding import max_nesting, python_syntax_error, decode, MAX_NESTING
from ampdoctor.lint.dispatch import Dispatcher, active_rules
from ampdoctor.lint.fixes import keep_final_cr, select_non_overlapping, apply_fixes, text_edits
from ampdoctor.lint.positions import node_positions
MAX_FIX_ROUNDS = 10
# files larger than this are linted a group of top-level statements at a time (memory)
LARGE_FILE = 256 * 1024
CHUNK_CHARS = 128 * 1024
DATA_CHARS = 16 * 1024  # a top-level statement of constant data this large is not parsed
LARGE_TREE = 30_000  # ... and only when its tree is large (Python ast nodes; libcst keeps ~5 KB per node)

# Deeply nested code exhausts Python's recursion limit in libcst (positions, code generation)
# and in rules. Such a file is linted again in a thread with a large stack and a higher limit.
DEEP_RECURSION_LIMIT = 60_000
DEEP_STACK_SIZE = 1 << 30  # address space only: pages the run does not touch are never used
_deep = threading.local()


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
        python = python_syntax_error(text)
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

    ctx = Context(path=path, min_torch=settings.min_torch, text=text)
    rules = [cls(ctx) for cls in active_rules(settings.enabled, text.encode("utf-8", "surrogatepass"), path)]
    dispatcher = Dispatcher(ctx, rules)
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
    positions = node_positions(module, text, targets)
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
            new_code = keep_final_cr(text, apply_fixes(module, [rep.fix]))
            edits = text_edits(text, new_code)
            if edits:
                fix = Fix(rep.fix.title or rep.rule.fix_title or "Apply fix",
                          Applicability.SAFE if rep.fix.safe else Applicability.UNSAFE, edits)
        short, explanation = messages.split(_one_line(rep.message))
        diag = Diagnostic(
            path=path, line=rng.start.line, column=rng.start.column + 1, code=rep.rule.code,
            end_line=rng.end.line, end_column=rng.end.column + 1, name=info.name,
            severity=info.severity, message=short, explanation=explanation,
            fix_title=(rep.fix.title or rep.rule.fix_title) if rep.fix else
            (rep.rule.fix_title if rep.rule.fix_availability == "suggestion" else None), fix=fix,
            premises=tuple(sorted({r.start.line for r in map(positions.get, rep.premises) if r is not None})),
            completed_by=rep.completed_by,
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
        python = python_syntax_error(decode(data)[0])
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
    if not active_rules(enabled, data, path) and not has_sup:
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
    too_deep = python_syntax_error(text) if max_nesting(data) >= MAX_NESTING else None
    if too_deep is not None:
        errors.append(_diag_at(path, SYNTAX_ERROR, *too_deep))
        passed = _Pass(None, [], [])
    elif len(text) > LARGE_FILE and not settings.fix:  # fixing needs the whole tree
        passed = _lint_chunked(path, text, settings, errors)
    else:
        passed = _lint_text(path, current, settings, errors)
    if settings.fix and passed.module is not None:
        allow_unsafe = settings.fix == "unsafe"
        first, first_errors = passed, list(errors)
        for _ in range(MAX_FIX_ROUNDS):
            reported = {id(d) for d in suppress.apply(path, current, data, passed.diagnostics, settings)}
            candidates = [f for f in passed.fixable if id(f[0]) in reported]
            chosen = select_non_overlapping(candidates, allow_unsafe)
            if not chosen:
                break
            new_text = keep_final_cr(current, apply_fixes(passed.module, [c[1] for c in chosen]))
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
            result.applied.extend(c[0] for c in chosen)
        else:
            # still fixing after MAX_FIX_ROUNDS: a fix brings back what it fixed and would be
            # applied over and over, so none is applied
            current, passed, result.fixes_applied = text, first, 0
            result.applied = []
            errors = first_errors + [_diag_at(path, INTERNAL_ERROR, 1, 1,
                                              f"fixes did not converge after {MAX_FIX_ROUNDS} rounds; "
                                              "the file was left as it was")]
        if current != text:
            result.fixed = current.encode(encoding)
    diags = passed.diagnostics + _filter_engine(errors, enabled)
    result.diagnostics = sorted(suppress.apply(path, current, result.fixed or data, diags, settings))
    return result


def _lint_chunked(path: str, text: str, settings: Settings, errors: list[Diagnostic]) -> _Pass:
    """A very large (usually generated) file, linted a group of top-level statements at a time
    so that only one group's tree is in memory: each group after the first gets the file's
    top-level imports in front of it, and positions are mapped back. Facts do not cross groups,
    and no fix edits are offered (``module`` stays None); ``--fix`` parses the whole file."""
    try:
        tree_ = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return _lint_text(path, text, settings, errors)  # the whole-file path reports it
    lines = text.splitlines(keepends=True)
    body = tree_.body
    if len(body) < 2 or sum(1 for _ in ast.walk(tree_)) < LARGE_TREE:
        return _lint_text(path, text, settings, errors)  # large text, small tree (docs, comments)

    def start(n: ast.stmt) -> int:
        return min([n.lineno, *(d.lineno for d in getattr(n, "decorator_list", ()))])

    header = "".join("".join(lines[n.lineno - 1:n.end_lineno]) for n in body
                     if isinstance(n, (ast.Import, ast.ImportFrom)))
    header_lines = header.count("\n")
    # (first line, last line, source, lines put in front of the first): 1-based
    groups: list[tuple[int, int, str, int]] = []
    first, size = 1, 0

    def close(hi: int) -> None:
        if first <= hi:
            groups.append((first, hi, "".join(lines[first - 1:hi]), 0))

    for i, n in enumerate(body):
        nxt = start(body[i + 1]) if i + 1 < len(body) else len(lines) + 1
        own = sum(len(x) for x in lines[start(n) - 1:nxt - 1])
        if own >= DATA_CHARS and _constant_data(n):
            # a generated table (`META = {(...): (...), ...}`): no rule looks inside pure data, and
            # its tree alone would take hundreds of MB
            close(start(n) - 1)
            first, size = nxt, 0
            continue
        pieces = _literal_pieces(n, lines) if own >= 2 * CHUNK_CHARS else None
        if pieces:
            close(start(n) - 1)
            groups += pieces
            first, size = nxt, 0
            continue
        size += own
        if size >= CHUNK_CHARS or i + 1 == len(body):
            close(nxt - 1)
            first, size = nxt, 0
    quiet = Settings(enabled=settings.enabled, min_torch=settings.min_torch, fix=None, want_edits=False)
    out: list[Diagnostic] = []
    for k, (lo, hi, source, lead) in enumerate(groups):
        prefix = header if k else ""
        shift = lo - 1 - (header_lines if k else 0) - lead
        chunk_errors: list[Diagnostic] = []
        passed = _lint_text(path, prefix + source, quiet, chunk_errors)
        for d in passed.diagnostics + chunk_errors:
            if k and d.line <= header_lines:
                continue  # the copied imports: reported with the first group
            moved = dataclasses.replace(d, line=d.line + shift, end_line=d.end_line + shift, fix=None)
            (errors if d in chunk_errors else out).append(moved)
        del passed
    return _Pass(None, out, [])


_DISPLAYS = {ast.List: "[]", ast.Tuple: "()", ast.Set: "{}", ast.Dict: "{}"}


def _literal_pieces(n: ast.stmt, lines: list[str]) -> list[tuple[int, int, str, int]] | None:
    """A top-level statement whose value is a list, tuple, set or dict display too large to parse
    at once (torch's `op_db: list[OpInfo] = [OpInfo(...), ...]`, 660 KB, takes over 400 MB as one
    tree), cut between its elements where an element starts a line: each piece is linted as
    ``_ = [`` + its lines + ``]``, one line put in front. None when it cannot be cut that way."""
    value = n.value if isinstance(n, (ast.Assign, ast.AnnAssign, ast.Expr)) else None
    brackets = _DISPLAYS.get(type(value))
    if brackets is None:
        return None
    if isinstance(value, ast.Dict):
        starts, ends = list(value.keys), list(value.values)  # `**x` has no key: not cut
    else:
        starts = ends = list(value.elts)  # type: ignore[union-attr]
    if not starts or any(k is None for k in starts):
        return None

    def leads_line(e: ast.expr) -> bool:
        return not lines[e.lineno - 1].encode("utf-8")[:e.col_offset].strip()

    if not leads_line(starts[0]):
        return None
    cuts, size = [0], 0  # the elements where a piece starts
    for i in range(1, len(starts)):
        size += sum(len(x) for x in lines[starts[i - 1].lineno - 1:starts[i].lineno - 1])
        if size >= CHUNK_CHARS and leads_line(starts[i]) and ends[i - 1].end_lineno < starts[i].lineno:
            cuts.append(i)
            size = 0
    if len(cuts) < 2:
        return None
    last = ends[-1]
    tail = lines[last.end_lineno - 1].encode("utf-8")[:last.end_col_offset].decode("utf-8", "replace")
    out = []
    for j, c in enumerate(cuts):
        lo = starts[c].lineno
        if j + 1 < len(cuts):
            hi = starts[cuts[j + 1]].lineno - 1
            src = "".join(lines[lo - 1:hi])
        else:
            hi = last.end_lineno
            src = "".join(lines[lo - 1:hi - 1]) + tail + "\n"
        piece = f"_ = {brackets[0]}\n{src}{brackets[1]}\n"
        try:
            ast.parse(piece)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None  # an odd layout: the statement is linted whole
        out.append((lo, hi, piece, 1))
    return out


def _constant_data(n: ast.stmt) -> bool:
    """An assignment or expression statement whose value is literal data only: constants, names
    and dotted names (`torch.float16` as a key), containers of them, unary minus; no calls."""
    value = n.value if isinstance(n, (ast.Assign, ast.AnnAssign, ast.Expr)) else None
    if value is None:
        return False
    for x in ast.walk(value):
        if not isinstance(x, (ast.Constant, ast.Dict, ast.List, ast.Tuple, ast.Set, ast.UnaryOp, ast.USub,
                              ast.UAdd, ast.Load, ast.Name, ast.Attribute)):
            return False
    return True


def _filter_engine(errors: list[Diagnostic], enabled: frozenset[str]) -> list[Diagnostic]:
    # internal errors are always reported: hiding them would hide unchecked code
    return [d for d in errors if d.code in enabled or d.code == INTERNAL_ERROR.code]
