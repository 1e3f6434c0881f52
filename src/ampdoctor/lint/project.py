"""Which definitions a project ever refers to (stdlib only: no libcst, no torch).

A defect in a class nobody instantiates or a helper nobody calls never runs, and a maintainer
dismisses the finding. After linting, the defect rules' findings inside a module-level
definition are checked against the whole project (the enclosing git work tree, else the
outermost folder with a pyproject.toml / setup.py / setup.cfg, else the linted files): a
definition is *referenced* when its name occurs

- in module-level code of any Python file (an import in an ``__init__.py``, ``__all__``,
  ``if __name__ == "__main__": main()``, a registry table),
- in any non-Python text file of the project (YAML/JSON/TOML configs naming a class, shell
  scripts, setup.cfg entry points, docs),
- inside another definition that is itself referenced (transitively; cycles do not count),
- or when the definition is decorated by something that may register it (``@MODELS.register``,
  ``@pytest.fixture``, ``@app.command``), or is a test (``test_*`` / ``Test*`` in a test file).

Uses from test code only (test files, a module's own ``_test_*`` self-checks) do not count for
product code. A file none of whose definitions is used anywhere (a standalone script, a snippet,
a module loaded by path) is left alone: its entry points are unknown.

Names are matched as words, in code, in attribute access and in string constants, so the test
over-approximates use: it only hides findings in code that nothing anywhere names. A private
method (``_name``) of a referenced class is checked the same way on its own name.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ampdoctor.diagnostics import Diagnostic

# project text files whose mention of a name counts as a use
TEXT_SUFFIXES = (".py", ".pyi", ".yaml", ".yml", ".json", ".toml", ".cfg", ".ini", ".sh", ".txt",
                 ".md", ".rst", ".ipynb", ".jsonnet", ".conf", ".gin")
MAX_TEXT_BYTES = 4 * 1024 * 1024
MAX_PROJECT_FILES = 60_000
_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", ".git", ".hg", ".svn", ".tox", ".nox",
              ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".ampdoctor_cache"}
_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg")
# decorators that wrap a function without registering it anywhere
_PLAIN_DECORATORS = {
    "no_grad", "inference_mode", "enable_grad", "set_grad_enabled", "script", "compile", "jit",
    "ignore", "unused", "export", "lru_cache", "cache", "cached_property", "property", "setter",
    "getter", "deleter", "staticmethod", "classmethod", "dataclass", "wraps", "contextmanager",
    "asynccontextmanager", "autocast", "custom_fwd", "custom_bwd", "abstractmethod", "overload",
    "final", "total_ordering", "unique", "once_differentiable", "njit", "torch_compile",
    "disable", "allow_in_graph", "override", "deprecated",
}


def gated(code: str) -> bool:
    """Defect rules (AMP1xx-AMP4xx) are silent in unreferenced code; deprecations are not."""
    return len(code) == 6 and code.startswith("AMP") and code[3] in "1234"


def project_root(path: Path) -> Path | None:
    """The enclosing git work tree, else the outermost folder with a Python project marker."""
    outer = None
    for d in path.resolve().parents:
        if (d / ".git").exists():
            return d
        if any((d / m).is_file() for m in _MARKERS):
            outer = d
    return outer


def project_files(root: Path) -> list[str] | None:
    """Every text file of the project, or None when there are too many to read."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for f in filenames:
            if f.endswith(TEXT_SUFFIXES):
                out.append(os.path.join(dirpath, f))
                if len(out) > MAX_PROJECT_FILES:
                    return None
    return out


def _is_test_file(path: str) -> bool:
    name = os.path.basename(path)
    parts = set(Path(path).parts)
    return (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
            or bool(parts & {"tests", "test", "testing"}))


def _test_code(path: str, node: ast.AST) -> bool:
    """A test file's definitions, a module's own self-tests (``_test_*``), unittest classes."""
    if _is_test_file(path):
        return True
    name = getattr(node, "name", "")
    if name.startswith("_test"):
        return True
    if isinstance(node, ast.ClassDef) and name.startswith("Test"):
        return any(_decorator_name(b) in ("TestCase", "IsolatedAsyncioTestCase") for b in node.bases)
    return False


def _decorator_name(node: ast.expr) -> str:
    while isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _registers(node: ast.AST) -> bool:
    decos = getattr(node, "decorator_list", ())
    return any(_decorator_name(d) not in _PLAIN_DECORATORS for d in decos)


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _top_defs(tree: ast.Module) -> dict[str, list[ast.AST]]:
    """Module-level definitions by name (also those inside module-level if/try/with)."""
    out: dict[str, list[ast.AST]] = {}
    todo = list(tree.body)
    while todo:
        st = todo.pop()
        if isinstance(st, _DEFS):
            out.setdefault(st.name, []).append(st)
        elif isinstance(st, (ast.If, ast.Try, ast.With, ast.For, ast.While)) or type(st).__name__ == "TryStar":
            for f in ("body", "orelse", "finalbody"):
                todo.extend(getattr(st, f, ()))
            for h in getattr(st, "handlers", ()):
                todo.extend(h.body)
    return out


def chain_at(tree: ast.Module, line: int) -> list[ast.AST]:
    """The definitions around ``line``, outermost first; [] at module level."""
    chain: list[ast.AST] = []
    body: Iterable[ast.AST] = tree.body
    while True:
        inner = None
        for st in _walk_statements(body):
            if isinstance(st, _DEFS):
                first = min([st.lineno] + [d.lineno for d in st.decorator_list])
                if first <= line <= (st.end_lineno or st.lineno):
                    inner = st
                    break
        if inner is None:
            return chain
        chain.append(inner)
        body = inner.body


def _walk_statements(body: Iterable[ast.AST]):
    """Statements of a body, descending into compound statements that are not definitions."""
    for st in body:
        yield st
        if not isinstance(st, _DEFS):
            for f in ("body", "orelse", "finalbody"):
                yield from _walk_statements(getattr(st, f, ()) or ())
            for h in getattr(st, "handlers", ()) or ():
                yield from _walk_statements(h.body)
            for c in getattr(st, "cases", ()) or ():
                yield from _walk_statements(c.body)


def _word(name: str) -> re.Pattern:
    return re.compile(rb"(?<![A-Za-z0-9_])" + re.escape(name.encode()) + rb"(?![A-Za-z0-9_])")


@dataclass
class _Occurrence:
    path: str
    container: ast.AST | None  # outermost definition holding it; None at module level
    root: bool = False  # counts as a use by itself


@dataclass
class Project:
    files: list[str]
    _trees: dict[str, ast.Module | None] = field(default_factory=dict)
    _data: dict[str, bytes] = field(default_factory=dict)
    _memo: dict[tuple[str, int], bool] = field(default_factory=dict)
    _hits: dict[str, list[str]] = field(default_factory=dict)
    _occ: dict[str, list[_Occurrence]] = field(default_factory=dict)

    # -- reading -------------------------------------------------------------------------
    def _bytes(self, path: str) -> bytes:
        hit = self._data.get(path)
        if hit is None:
            try:
                if os.path.getsize(path) > MAX_TEXT_BYTES:
                    hit = b""
                else:
                    with open(path, "rb") as f:
                        hit = f.read()
            except OSError:
                hit = b""
            if path.endswith(".py"):
                pass  # Python sources are read again when needed: most hold no candidate name
            else:
                self._data[path] = hit
        return hit

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._trees:
            try:
                with open(path, "rb") as f:
                    self._trees[path] = ast.parse(f.read(), filename=path)
            except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
                self._trees[path] = None
        return self._trees[path]

    def index(self, names: Iterable[str]) -> None:
        """One pass over the project's files for every name not looked up yet."""
        todo = sorted({n for n in names if n not in self._hits})
        if not todo:
            return
        for n in todo:
            self._hits[n] = []
        pat = re.compile(rb"(?<![A-Za-z0-9_])(" + b"|".join(re.escape(n.encode()) for n in todo)
                         + rb")(?![A-Za-z0-9_])")
        for path in self.files:
            data = self._bytes(path)
            if not data:
                continue
            for m in set(pat.findall(data)):
                self._hits[m.decode()].append(path)

    # -- occurrences ---------------------------------------------------------------------
    def _occurrences(self, name: str) -> list[_Occurrence]:
        hit = self._occ.get(name)
        if hit is not None:
            return hit
        self.index([name])
        out: list[_Occurrence] = []
        for path in self._hits[name]:
            if not path.endswith((".py", ".pyi")):
                out.append(_Occurrence(path, None, root=True))
                continue
            tree = self.tree(path)
            if tree is None:
                out.append(_Occurrence(path, None, root=True))  # unreadable: assume a use
                continue
            out.extend(_uses_in(path, tree, name, os.path.basename(path) == "__init__.py"))
        self._occ[name] = out
        return out

    def referenced(self, path: str, node: ast.AST) -> bool:
        """Whether the module-level definition ``node`` of ``path`` is ever used: a search from
        it through the definitions that name it, up to a use that counts by itself."""
        key = (path, id(node))
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        seen = {key}
        frontier = [(path, node)]
        result = False
        while frontier and not result:
            self.index(n.name for _, n in frontier)  # one pass over the files per level
            nxt = []
            for p, n in frontier:
                for ref in self._referrers(p, n):
                    if ref is None or self._memo.get((ref[0], id(ref[1]))):
                        result = True
                        break
                    k = (ref[0], id(ref[1]))
                    if k not in seen and k not in self._memo:
                        seen.add(k)
                        nxt.append(ref)
                if result:
                    break
            frontier = nxt
        self._memo[key] = result
        return result

    def _referrers(self, path: str, node: ast.AST):
        """The definitions that name ``node``; None for a use that counts by itself."""
        name = node.name
        if name.startswith("__") or _registers(node):
            yield None
            return
        in_tests = _is_test_file(path)
        if in_tests and (name.startswith("test") or name.startswith("Test")):
            yield None
            return
        for occ in self._occurrences(name):
            if occ.root or occ.container is None:
                yield None
                return
            if occ.path == path and occ.container is node:
                continue  # the definition naming itself (recursion, super(Name, self))
            if not in_tests and _test_code(occ.path, occ.container):
                continue  # product code that only tests exercise does not run in training
            yield (occ.path, occ.container)

    def in_use(self, path: str, tree: ast.Module) -> bool:
        """Whether the project uses this file at all (some module-level definition is referenced).

        A file none of whose definitions is used anywhere is a standalone script or snippet, or
        one loaded in a way no text shows (by path, by a plugin system): its entry points are
        unknown, so nothing in it is treated as unused."""
        key = (path, id(tree))
        hit = self._memo.get(key)
        if hit is None:
            tops = [n for ns in _top_defs(tree).values() for n in ns]
            self.index(n.name for n in tops)
            hit = any(self.referenced(path, n) for n in tops)
            self._memo[key] = hit
        return hit

    def method_referenced(self, path: str, cls: ast.ClassDef, method: ast.AST) -> bool:
        """A private method is used when its name occurs outside itself in referenced code."""
        name = method.name
        if not name.startswith("_") or name.startswith("__") or _registers(method):
            return True
        for occ in self._occurrences(name):
            if occ.root or occ.container is None:
                return True
            if occ.path == path and occ.container is cls:
                if _outside(cls, method, name):
                    return True
                continue
            if self.referenced(occ.path, occ.container):
                return True
        return False


def _outside(cls: ast.ClassDef, method: ast.AST, name: str) -> bool:
    """Whether ``name`` occurs in ``cls`` outside ``method``'s own body."""
    for st in cls.body:
        if st is method:
            continue
        for n in ast.walk(st):
            if _names(n, name):
                return True
    return False


def _names(n: ast.AST, name: str) -> bool:
    if isinstance(n, ast.Name):
        return n.id == name
    if isinstance(n, ast.Attribute):
        return n.attr == name
    if isinstance(n, ast.Constant) and isinstance(n.value, str):
        return name in n.value and _word(name).search(n.value.encode("utf-8", "replace")) is not None
    if isinstance(n, ast.keyword):
        return n.arg == name
    return False


def _uses_in(path: str, tree: ast.Module, name: str, init: bool):
    """Occurrences of ``name`` in a module, each with its outermost enclosing definition."""
    for st in _walk_statements(tree.body):
        if isinstance(st, _DEFS):
            yield from _uses_under(path, st, st, name, init)
        else:
            # a compound statement's own expressions (its body's statements come separately)
            for child in ast.iter_child_nodes(st):
                if not isinstance(child, (ast.stmt, ast.excepthandler)) and type(child).__name__ != "match_case":
                    yield from _uses_under(path, child, None, name, init)
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                yield from _uses_under(path, st, None, name, init)


def _uses_under(path: str, node: ast.AST, holder, name: str, init: bool):
    for n in ast.walk(node):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                bound = a.asname or a.name.split(".")[0]
                if a.name.split(".")[-1] == name or bound == name:
                    # a re-export in a package's __init__ or under another name is a use;
                    # a plain import is not: the importing module's own uses are found by name
                    if init or (a.asname and a.asname != name):
                        yield _Occurrence(path, holder, root=holder is None)
        elif _names(n, name):
            yield _Occurrence(path, holder)


def _chain_names(chain: list[ast.AST]) -> str:
    return ".".join(getattr(n, "name", "?") for n in chain)


@dataclass
class Hidden:
    diagnostic: Diagnostic
    where: str  # the unreferenced definition, e.g. "SRLinear" or "Trainer._old_step"


def split_unreferenced(diags: list[Diagnostic], real_paths: dict[str, Path],
                       linted: list[Path]) -> tuple[list[Diagnostic], list[Hidden]]:
    """Keep the diagnostics in referenced code; return the others with the definition's name."""
    candidates = [d for d in diags if gated(d.code) and d.path in real_paths]
    if not candidates:
        return diags, []
    projects: dict[Path | None, Project | None] = {}
    linted_files = [os.fspath(p) for p in linted]

    def project_for(p: Path) -> Project | None:
        root = project_root(p)
        if root not in projects:
            if root is None:
                files = linted_files
            else:
                files = project_files(root)
                if files is not None:
                    seen = set(files)
                    files += [f for f in linted_files if f not in seen and f.startswith(os.fspath(root))]
            projects[root] = Project(files) if files is not None else None
        return projects[root]

    hidden: list[Hidden] = []
    drop: set[int] = set()
    per_file: dict[str, list[Diagnostic]] = {}
    for d in candidates:
        per_file.setdefault(d.path, []).append(d)
    for display, ds in per_file.items():
        real = real_paths[display]
        proj = project_for(real)
        if proj is None:
            continue
        path = os.fspath(real)
        if path not in proj.files:
            proj.files.append(path)
        tree = proj.tree(path)
        if tree is None:
            continue
        chains = [(d, chain_at(tree, d.line)) for d in ds]
        proj.index(c[0].name for _, c in chains if c)
        for d, chain in chains:
            if not chain:
                continue
            top = chain[0]
            unused = None
            if not proj.referenced(path, top) and proj.in_use(path, tree):
                unused = chain[:1]
            elif isinstance(top, ast.ClassDef) and len(chain) > 1 and not isinstance(chain[1], ast.ClassDef):
                if not proj.method_referenced(path, top, chain[1]):
                    unused = chain[:2]
            if unused is not None:
                drop.add(id(d))
                hidden.append(Hidden(d, _chain_names(unused)))
    kept = [d for d in diags if id(d) not in drop]
    return kept, hidden
