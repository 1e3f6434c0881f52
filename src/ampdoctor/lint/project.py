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

Code under documentation, benchmark and legacy folders is not product code. A finding that
depends on other code of its file (``Report.premises``: AMP110's resume path) is dropped when
none of that code can run either; for such code a public method whose name nothing else in the
project mentions, in a class with no base from outside the file, counts as never called.

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
from collections import OrderedDict
from functools import lru_cache
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


# folders whose code is not what a training run executes: what each is called in the summary
_NOT_PRODUCT = {"docs": "documentation", "doc": "documentation", "benchmarks": "benchmark",
                "benchmark": "benchmark", "legacy": "legacy code", "deprecated": "legacy code",
                "obsolete": "legacy code", "outdated": "legacy code", "archive": "legacy code",
                "archived": "legacy code", "attic": "legacy code", "backup": "legacy code"}


def _docs_folder(path: str, root: Path | None) -> str | None:
    """The folder of the project (below ``root``) that holds ``path`` and is not product code
    (documentation, benchmarks, legacy code), as "name/ (what it is)"; None for product code."""
    p = Path(path)
    try:
        parts = p.relative_to(root).parts if root is not None else p.parts
    except ValueError:
        parts = p.parts
    for part in parts[:-1]:
        kind = _NOT_PRODUCT.get(part.lower().strip("_"))
        if kind is not None:
            return f"{part}/ ({kind})"
    return None


def test_path(path: str) -> bool:
    """A ``test_*.py``/``*_test.py``/``conftest.py`` file, or any file under a ``tests``/``test``
    folder (a test suite's helper modules: ``test/models/common/optimization.py``)."""
    parts = path.replace("\\", "/").split("/")
    name = parts[-1]
    if name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py":
        return True
    return any(p in ("tests", "test") for p in parts[:-1])


def _is_test_file(path: str) -> bool:
    """``test_path``, or a file under a ``testing`` folder (uses from there make nothing used)."""
    return test_path(path) or "testing" in Path(path).parts


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


def _top_defs(tree: ast.Module) -> list[ast.AST]:
    """Module-level definitions (also those inside module-level if/try/with/for)."""
    return [st for st in _walk_statements(tree.body) if isinstance(st, _DEFS)]


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


@lru_cache(maxsize=1024)
def _word(name: str) -> re.Pattern:
    return re.compile(rb"(?<![A-Za-z0-9_])" + re.escape(name.encode()) + rb"(?![A-Za-z0-9_])")


@dataclass(frozen=True)
class _Def:
    """A module-level definition, by value: results stay valid after its tree is dropped."""

    path: str
    name: str
    line: int
    registers: bool  # a decorator that may register it
    test: bool  # test code (a test file, `_test_*`, a unittest class)


def _def(path: str, node: ast.AST) -> _Def:
    return _Def(path, node.name, node.lineno, _registers(node), _test_code(path, node))


@dataclass
class _Occurrence:
    path: str
    container: _Def | None  # outermost definition holding it; None: a use by itself (module level, a config)
    method: str | None = None  # the method of a class container it is in


TREE_CACHE = 16  # parsed files kept at once (a common name can occur in hundreds)


@dataclass
class Project:
    files: list[str]
    _trees: "OrderedDict[str, ast.Module | None]" = field(default_factory=OrderedDict)
    _memo: dict = field(default_factory=dict)
    _hits: dict[str, list[str]] = field(default_factory=dict)
    _occ: dict[str, list[_Occurrence]] = field(default_factory=dict)
    _texts: dict[str, list[str]] = field(default_factory=dict)

    # -- reading -------------------------------------------------------------------------
    @staticmethod
    def _bytes(path: str) -> bytes:
        try:
            if os.path.getsize(path) > MAX_TEXT_BYTES:
                return b""
            with open(path, "rb") as f:
                return f.read()
        except OSError:
            return b""

    def tree(self, path: str) -> ast.Module | None:
        if path in self._trees:
            self._trees.move_to_end(path)
            return self._trees[path]
        try:
            with open(path, "rb") as f:
                t = ast.parse(f.read(), filename=path)
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            t = None
        self._trees[path] = t
        if len(self._trees) > TREE_CACHE:
            self._trees.popitem(last=False)
        return t

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
                out.append(_Occurrence(path, None))
                continue
            tree = self.tree(path)
            if tree is None:
                out.append(_Occurrence(path, None))  # unreadable: assume a use
                continue
            out.extend(_uses_in(path, tree, name, os.path.basename(path) == "__init__.py"))
        self._occ[name] = out
        return out

    def referenced(self, d: _Def) -> bool:
        """Whether the module-level definition ``d`` is ever used: a search from it through the
        definitions that name it, up to a use that counts by itself."""
        if d not in self._memo:
            self.resolve([d])
        return self._memo[d]

    def resolve(self, starts: Iterable[_Def]) -> None:
        """`referenced` for many definitions at once: one breadth-first search per start, run
        level by level together, so each level reads the project's files once for all of them."""
        todo = [d for d in dict.fromkeys(starts) if d not in self._memo]
        state = {d: ({d}, [d]) for d in todo}  # start -> (seen, frontier)
        while state:
            self.index(x.name for _, frontier in state.values() for x in frontier)
            done = []
            for d, (seen, frontier) in state.items():
                nxt = []
                found = False
                for x in frontier:
                    for ref in self._referrers(x):
                        if ref is None or self._memo.get(ref):
                            found = True
                            break
                        if ref not in seen and ref not in self._memo:
                            seen.add(ref)
                            nxt.append(ref)
                    if found:
                        break
                if found or not nxt:
                    self._memo[d] = found
                    done.append(d)
                else:
                    state[d] = (seen, nxt)
            for d in done:
                del state[d]

    def _referrers(self, d: _Def):
        """The definitions that name ``d``; None for a use that counts by itself."""
        if d.name.startswith("__") or d.registers or self._looked_up(d.name):
            yield None
            return
        in_tests = _is_test_file(d.path)
        if in_tests and (d.name.startswith("test") or d.name.startswith("Test")):
            yield None
            return
        for occ in self._occurrences(d.name):
            if occ.container is None:
                yield None
                return
            if occ.container == d:
                continue  # the definition naming itself (recursion, super(Name, self))
            if not in_tests and occ.container.test:
                continue  # product code that only tests exercise does not run in training
            yield occ.container

    def _looked_up(self, name: str) -> bool:
        """``name`` may be found by a name built at run time: ``getattr(module, model_name +
        "Trainer")`` (RecBole's trainer registry), ``globals()[f"build_{arch}"]``. Such a lookup
        uses every definition whose name has that prefix or suffix."""
        prefixes, suffixes = self._affixes()
        return any(name.startswith(p) and name != p for p in prefixes) or \
            any(name.endswith(x) and name != x for x in suffixes)

    def _affixes(self) -> tuple[set[str], set[str]]:
        hit = self._memo.get("affixes")
        if hit is None:
            hit = (set(), set())
            for f in self.files:
                if f.endswith(".py") and _DYNAMIC_NAME.search(self._bytes(f)):
                    tree = self.tree(f)
                    if tree is not None:
                        _dynamic_affixes(tree, *hit)
            self._memo["affixes"] = hit
        return hit

    def in_use(self, path: str, tree: ast.Module) -> bool:
        """Whether the project uses this file at all (some module-level definition is referenced).

        A file none of whose definitions is used anywhere is a standalone script or snippet, or
        one loaded in a way no text shows (by path, by a plugin system): its entry points are
        unknown, so nothing in it is treated as unused."""
        key = ("file", path)
        hit = self._memo.get(key)
        if hit is None:
            tops = [_def(path, n) for n in _top_defs(tree)]
            self.index(t.name for t in tops)
            hit = any(self.referenced(t) for t in tops)
            self._memo[key] = hit
        return hit

    def dead_module(self, path: str, tree: ast.Module) -> bool:
        """A module of a package that nothing imports or names: no `__main__` block, not a test, a
        package that does not import its modules by scanning its folder, and a module name that
        occurs in no other file of the project (no import, no string, no config or doc mention).
        A copy left beside the real one (`modeling_llama_.py`)."""
        key = ("dead", path)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        stem = os.path.basename(path).rsplit(".", 1)[0]
        hit = False
        init = os.path.join(os.path.dirname(path), "__init__.py")
        if stem.isidentifier() and stem != "__init__" and not _is_test_file(path) \
                and os.path.exists(init) and not _auto_imports(init) and not _has_main_block(tree):
            self.index([stem])
            hit = not any(p != path for p in self._hits[stem])
        self._memo[key] = hit
        return hit

    def _modules(self) -> dict[str, set[str]]:
        """Dotted name -> the folders holding it, for every module and package of the project
        under every name it could be imported by (``coati.models.base``, ``models.base``...)."""
        hit = self._memo.get("modules")
        if hit is None:
            hit = {}
            for f in self.files:
                if not f.endswith(".py"):
                    continue
                parts = Path(f).parts
                chain = [*parts[:-1], parts[-1][:-3]]
                for end in range(len(chain), 0, -1):  # the module, then each folder above it
                    if chain[end - 1] == "__init__":
                        continue
                    for start in range(max(0, end - 6), end):
                        hit.setdefault(".".join(chain[start:end]), set()).add(
                            os.path.join(*parts[:start]) if start else os.sep)
            self._memo["modules"] = hit
        return hit

    def unresolved_import(self, path: str, tree: ast.Module) -> str | None:
        """A module-level absolute import of the project's own package that names a module the
        project does not have (``from coati.models.bloom import ...`` where ``coati/models`` has
        no ``bloom``): a script left behind by a refactoring, which cannot run. Imports inside
        ``try`` (optional fallbacks) do not count, nor a top-level name that is only a folder."""
        key = ("imports", path)
        if key in self._memo:
            return self._memo[key]
        mods = self._modules()
        found = None
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if len(parts) < 3 or name in mods:
                    continue
                have = max((k for k in range(1, len(parts)) if ".".join(parts[:k]) in mods), default=0)
                if have < 2:
                    continue  # not the project's package (or only a folder of that name)
                if not self._leaf_exists(mods[".".join(parts[:have])], parts[:have], parts[have]):
                    found = name
                    break
            if found:
                break
        self._memo[key] = found
        return found

    @staticmethod
    def _leaf_exists(bases: set[str], prefix: list[str], leaf: str) -> bool:
        """Anything named ``leaf`` beside the package (a compiled extension, a .pyx, a data folder)."""
        for base in bases:
            folder = os.path.join(base, *prefix)
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            if any(n == leaf or n.startswith(leaf + ".") for n in names):
                return True
        return False

    def holding(self, text: str) -> list[str]:
        """The project's Python files whose source contains ``text`` (searched once per text)."""
        hit = self._texts.get(text)
        if hit is None:
            raw = text.encode()
            hit = self._texts[text] = [f for f in self.files if f.endswith(".py") and raw in self._bytes(f)]
        return hit

    def unused_chain(self, path: str, tree: ast.Module, chain: list[ast.AST],
                     strict: bool = False) -> list[ast.AST] | None:
        """The definitions (outermost first) that make the code at ``chain`` unused, or None when
        it may run. ``strict``: a public method counts as unused too when its name occurs nowhere
        else in the project and its class has no base from outside this file (nothing else, no
        framework, can call it): for code a finding depends on, not for the finding itself."""
        if not chain:
            return None
        top = _def(path, chain[0])
        if not self.referenced(top) and self.in_use(path, tree):
            return chain[:1]
        if isinstance(chain[0], ast.ClassDef) and len(chain) > 1 and not isinstance(chain[1], ast.ClassDef):
            if not self.method_referenced(top, chain[1]):
                return chain[:2]
            if strict and self._never_named(top, chain[0], chain[1], tree):
                return chain[:2]
        return None

    def _never_named(self, cls: _Def, node: ast.ClassDef, method: ast.AST, tree: ast.Module) -> bool:
        """A public method whose name nothing outside itself mentions, in a class whose bases are
        all classes of this file (or none): no caller, no framework hook."""
        name = method.name
        if name.startswith("__") or _registers(method):
            return False
        local = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for b in node.bases:
            if not (isinstance(b, ast.Name) and (b.id in local or b.id == "object")):
                return False
        return all(occ.container == cls and occ.method == name for occ in self._occurrences(name))

    def method_referenced(self, cls: _Def, method: ast.AST) -> bool:
        """A private method is used when its name occurs outside itself in referenced code."""
        name = method.name
        if not name.startswith("_") or name.startswith("__") or _registers(method):
            return True
        for occ in self._occurrences(name):
            if occ.container is None:
                return True
            if occ.container == cls:
                if occ.method != name:
                    return True  # another method of the class calls it
                continue
            if self.referenced(occ.container):
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
        if isinstance(st, ast.ClassDef):
            holder = _def(path, st)
            for part in (*st.bases, *st.keywords, *st.decorator_list):
                yield from _uses_under(path, part, holder, None, name, init)
            for child in st.body:
                method = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
                yield from _uses_under(path, child, holder, method, name, init)
        elif isinstance(st, _DEFS):
            yield from _uses_under(path, st, _def(path, st), None, name, init)
        else:
            # a compound statement's own expressions (its body's statements come separately)
            for child in ast.iter_child_nodes(st):
                if not isinstance(child, (ast.stmt, ast.excepthandler)) and type(child).__name__ != "match_case":
                    yield from _uses_under(path, child, None, None, name, init)
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                yield from _uses_under(path, st, None, None, name, init)


def _uses_under(path: str, node: ast.AST, holder, method, name: str, init: bool):
    for n in ast.walk(node):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            for a in n.names:
                bound = a.asname or a.name.split(".")[0]
                if a.name.split(".")[-1] == name or bound == name:
                    # a re-export in a package's __init__ or under another name is a use;
                    # a plain import is not: the importing module's own uses are found by name
                    if init or (a.asname and a.asname != name):
                        yield _Occurrence(path, holder, method)
        elif _names(n, name):
            yield _Occurrence(path, holder, method)


# a name built at run time and looked up: getattr(m, x + "Trainer"), globals()[f"build_{x}"]
# (arguments nested one call deep); only files that match are parsed
_DYNAMIC_NAME = re.compile(rb"""(?:getattr\(|globals\(\)\[|locals\(\)\[|vars\([^()]*\)\[)"""
                           rb"""(?:[^()\[\]]|\([^()]*\)|\[[^\[\]]*\])*?(?:\+\s*['"]|['"]\s*\+|\bf['"])""")


def _dynamic_affixes(tree: ast.Module, prefixes: set[str], suffixes: set[str]) -> None:
    """The fixed parts of names built at run time and looked up with ``getattr(obj, ...)`` or
    ``globals()[...]``: ``x + "Trainer"`` and ``f"{x}Trainer"`` give the suffix ``Trainer``,
    ``"build_" + x`` the prefix ``build_``."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" and len(n.args) >= 2:
            expr = n.args[1]
        elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name) \
                and n.value.func.id in ("globals", "locals", "vars"):
            expr = n.slice
        else:
            continue
        parts: list = []
        if isinstance(expr, ast.JoinedStr):
            parts = list(expr.values)
        elif isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            stack = [expr]
            while stack:  # flatten a + b + c, left to right
                e = stack.pop()
                if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
                    stack += [e.right, e.left]
                else:
                    parts.append(e)
        if len(parts) < 2:
            continue
        first, last = parts[0], parts[-1]
        for part, out in ((first, prefixes), (last, suffixes)):
            if isinstance(part, ast.Constant) and isinstance(part.value, str) and len(part.value) >= 3 \
                    and part.value.replace("_", "a").isalnum():
                out.add(part.value)


def _auto_imports(init: str) -> bool:
    """The package imports its modules by scanning its folder (fairseq's `import_models`,
    plugin registries): a module nobody names may still be loaded."""
    data = Project._bytes(init)
    return any(w in data for w in (b"import_module", b"__import__", b"pkgutil", b"listdir", b"glob",
                                   b"iter_modules", b"scandir", b"spec_from_file_location"))


def _has_main_block(tree: ast.Module) -> bool:
    for st in tree.body:
        if isinstance(st, ast.If) and "__main__" in ast.dump(st.test):
            return True
    return False


def _chain_names(chain: list[ast.AST]) -> str:
    return ".".join(getattr(n, "name", "?") for n in chain)


@dataclass
class Hidden:
    diagnostic: Diagnostic
    where: str  # the unreferenced definition, e.g. "SRLinear" or "Trainer._old_step"
    # why: "unused" (that definition), "folder" (documentation, benchmark, legacy code), "stale"
    # (the file imports a module the project lacks), "premise" (what it depends on never runs),
    # "elsewhere" (another file supplies what it says is missing)
    kind: str = "unused"


def split_unreferenced(diags: list[Diagnostic], real_paths: dict[str, Path],
                       linted: list[Path]) -> tuple[list[Diagnostic], list[Hidden]]:
    """Keep the diagnostics in referenced code; return the others with the definition's name."""
    candidates = [d for d in diags if gated(d.code) and d.path in real_paths]
    if not candidates:
        return diags, []
    projects: dict[Path | None, Project | None] = {}
    linted_files = [os.fspath(p) for p in linted]

    def project_for(root: Path | None) -> Project | None:
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
    # the definition around each finding, looked up for all of them in one search
    prepared = []
    premise_chains: dict[int, list[list[ast.AST]]] = {}  # id(diagnostic) -> the chain at each premise line
    for display, ds in per_file.items():
        real = real_paths[display]
        root = project_root(real)
        proj = project_for(root)
        if proj is None:
            continue
        path = os.fspath(real)
        docs = _docs_folder(path, root)
        if docs is not None:  # example code in the documentation, not the product: nothing to look up
            prepared.append((proj, path, None, [(d, None) for d in ds], docs))
            continue
        if path not in proj.files:
            proj.files.append(path)
        tree = proj.tree(path)
        if tree is not None:
            prepared.append((proj, path, tree, [(d, chain_at(tree, d.line)) for d in ds], None))
            for d in ds:
                if d.premises:
                    premise_chains[id(d)] = [chain_at(tree, line) for line in d.premises]
    for proj in {id(p[0]): p[0] for p in prepared}.values():
        mine = [p for p in prepared if p[0] is proj and p[4] is None]
        tops = [_def(path, c[0]) for _, path, _, chains, _ in mine for _, c in chains if c]
        tops += [_def(path, c[0]) for _, path, _, chains, _ in mine for d, _ in chains
                 for c in premise_chains.get(id(d), ()) if c]
        stems = [os.path.basename(path).rsplit(".", 1)[0] for _, path, _, _, _ in mine]
        proj.index([t.name for t in tops] + [x for x in stems if x.isidentifier()])
        proj.resolve(tops)
    for proj, path, tree, chains, docs in prepared:
        if docs is not None:
            for d, _ in chains:
                drop.add(id(d))
                hidden.append(Hidden(d, docs, "folder"))
            continue
        if proj.dead_module(path, tree):
            for d, _ in chains:
                drop.add(id(d))
                hidden.append(Hidden(d, os.path.basename(path) + " (never imported)"))
            continue
        stale = proj.unresolved_import(path, tree)
        if stale is not None:  # it cannot run: its findings cannot happen
            for d, _ in chains:
                drop.add(id(d))
                hidden.append(Hidden(d, f"{os.path.basename(path)} (imports {stale}, which the project lacks)", "stale"))
            continue
        for d, chain in chains:
            unused = proj.unused_chain(path, tree, chain)
            if unused is not None:
                drop.add(id(d))
                hidden.append(Hidden(d, _chain_names(unused)))
                continue
            if d.premises:
                dead = [proj.unused_chain(path, tree, c, strict=True) for c in premise_chains[id(d)]]
                if all(x is not None for x in dead):
                    drop.add(id(d))
                    hidden.append(Hidden(d, f"{_chain_names(dead[0])}, the code it depends on", "premise"))
                    continue
            done = next(((t, f) for t in d.completed_by for f in proj.holding(t) if f != path), None)
            if done is not None:
                drop.add(id(d))
                hidden.append(Hidden(d, f"{done[0].strip('.(')}() in {os.path.basename(done[1])}", "elsewhere"))
    kept = [d for d in diags if id(d) not in drop]
    return kept, hidden
