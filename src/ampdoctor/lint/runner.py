"""Run the engine over many files: settings per file, cache, process pool, writing fixes."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import hashlib
import multiprocessing
import os
import stat
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pathspec

from ampdoctor.config import Config
from ampdoctor.diagnostics import AmpdoctorError, Diagnostic
from ampdoctor.lint import cache as cache_mod
from ampdoctor.lint.discovery import Target
from ampdoctor.lint.registry import READ_ERROR, resolve_selection
from ampdoctor.lint.result import FileResult, Settings, diag_at

# below this many files to parse, starting worker processes costs more than it saves
POOL_MIN_FILES = 24


@dataclass(frozen=True)
class Selection:
    """Command-line rule selection; None/empty means "keep what the config says"."""

    select: tuple[str, ...] | None = None
    extend_select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    min_torch: tuple[int, ...] | None = None


@dataclass
class RunResult:
    results: list[FileResult] = field(default_factory=list)
    files: int = 0
    cached: int = 0
    # defect-rule findings in definitions nothing in the project refers to (not reported)
    unreferenced: list = field(default_factory=list)

    @property
    def diagnostics(self) -> list[Diagnostic]:
        return sorted(d for r in self.results for d in r.diagnostics)

    @property
    def fixes_applied(self) -> int:
        return sum(r.fixes_applied for r in self.results)

    @property
    def applied(self) -> list[Diagnostic]:
        """The diagnostics whose fixes were applied (as first reported, before the fix)."""
        return sorted(d for r in self.results for d in r.applied)


class SettingsResolver:
    """Per-file settings from the file's config, the command line and per-file-ignores."""

    def __init__(self, cli: Selection, fix: str | None, want_edits: bool) -> None:
        self.cli = cli
        self.fix = fix
        self.want_edits = want_edits
        self._base: dict[Config, frozenset[str]] = {}
        self._pfi: dict[Config, list[tuple[pathspec.PathSpec, frozenset[str]]]] = {}
        self._memo: dict[tuple, Settings] = {}

    def base(self, cfg: Config) -> frozenset[str]:
        hit = self._base.get(cfg)
        if hit is None:
            layers = [
                (list(cfg.select) if cfg.select is not None else None, list(cfg.extend_select), list(cfg.ignore)),
                (list(self.cli.select) if self.cli.select is not None else None,
                 list(self.cli.extend_select), list(self.cli.ignore)),
            ]
            try:
                hit = resolve_selection(layers)
                from ampdoctor.lint.registry import expand
                self._pfi[cfg] = [
                    (pathspec.GitIgnoreSpec.from_lines([pat]),
                     frozenset().union(*(expand(c) for c in codes)) if codes else frozenset())
                    for pat, codes in cfg.per_file_ignores
                ]
            except AmpdoctorError as exc:  # a code from the config file: say which file
                if cfg.source is None or str(cfg.source) in str(exc):
                    raise
                raise AmpdoctorError(f"{cfg.source}: {exc}") from None
            self._base[cfg] = hit
        return hit

    def for_file(self, path: Path, cfg: Config) -> Settings:
        enabled = self.base(cfg)
        try:
            rel = path.relative_to(cfg.root).as_posix()
        except ValueError:
            rel = path.as_posix()
        dropped = frozenset().union(*(codes for spec, codes in self._pfi[cfg] if spec.match_file(rel)))
        min_torch = self.cli.min_torch or cfg.min_torch_version
        key = (enabled - dropped, min_torch)
        s = self._memo.get(key)
        if s is None:
            s = self._memo[key] = Settings(enabled - dropped, min_torch, self.fix, self.want_edits)
        return s


def rules_fingerprint() -> str:
    """Changes whenever the linter's own code changes, so stale cache entries are never used."""
    h = hashlib.blake2b(digest_size=12)
    lint_dir = Path(__file__).parent
    for p in sorted(lint_dir.rglob("*.py")):
        try:
            st = p.stat()
        except OSError:
            continue
        h.update(f"{p.relative_to(lint_dir)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _read(path: Path) -> bytes | str:
    # O_NONBLOCK: opening a FIFO must not wait for a writer; only regular files are read (a
    # FIFO or a device such as /dev/zero would block or never end)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except IsADirectoryError:
        return "it is a folder"
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        with open(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                return "it is a folder"
            if not stat.S_ISREG(mode):
                return "not a regular file"
            return f.read()
    except IsADirectoryError:
        return "it is a folder"
    except OSError as exc:
        return exc.strerror or str(exc)


def _work(item: tuple[str, str, Settings]) -> FileResult:
    from ampdoctor.lint.engine import lint_bytes  # libcst is imported only when there is parsing to do

    display, path, settings = item
    data = _read(Path(path))
    if isinstance(data, str):
        return FileResult(display, [diag_at(display, READ_ERROR, 1, 1, f"cannot read the file: {data}")])
    return lint_bytes(display, data, settings)


def _work_chunk(items: list[tuple[str, str, Settings]]) -> list[FileResult]:
    return [_work(i) for i in items]


def write_atomic(path: Path, data: bytes) -> None:
    """Replace a file's content atomically, keeping its permission bits and owner.

    A symbolic link is not written (replacing it would turn the link into a copy, writing
    through it would change a file that may lie outside the linted paths), nor is a read-only
    file (the rename would bypass the protection)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.EPERM, "it is a symbolic link (fix the file it points to)")
    mode = st.st_mode & 0o7777
    if not mode & 0o222 or not os.access(path, os.W_OK):
        raise OSError(errno.EACCES, "it is read-only")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".ampdoctor-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if hasattr(os, "chown") and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
            try:
                os.chown(tmp, st.st_uid, st.st_gid)
            except OSError:
                pass  # not allowed to give the file away: it keeps our ownership
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def run(
    targets: Sequence[Target],
    resolver: SettingsResolver,
    *,
    jobs: int | None = None,
    cache_dir: Path | None = None,
    write_fixes: bool = False,
    progress: Callable[[int], None] | None = None,
    referenced_only: bool = False,
) -> RunResult:
    out = RunResult(files=len(targets))
    cache = cache_mod.Cache(cache_dir) if cache_dir is not None else None
    fingerprint = rules_fingerprint() if cache is not None else ""
    todo: list[tuple[str, str, Settings]] = []
    keys: dict[str, str] = {}
    fixing = resolver.fix is not None
    for t in targets:
        settings = resolver.for_file(t.path, t.config)
        if cache is not None:
            data = _read(t.path)
            if isinstance(data, bytes):
                skey = cache_mod.settings_key(settings.enabled, settings.min_torch, fingerprint)
                key = cache_mod.content_key(data, skey + ("E" if settings.want_edits else ""))
                keys[t.display] = key
                hit = cache.get(str(t.path), key)
                if hit is not None and not (fixing and any(isinstance(d, dict) and d.get("fix") for d in hit)):
                    diags = _from_cache(hit, t.display)
                    if diags is not None:
                        out.results.append(FileResult(t.display, diags))
                        out.cached += 1
                        if progress:
                            progress(1)
                        continue
        todo.append((t.display, str(t.path), settings))

    results = _execute(todo, jobs, progress)
    by_display = {t.display: t for t in targets}
    for r in results:
        t = by_display[r.path]
        write_failed = False
        if r.fixed is not None and write_fixes:
            try:
                write_atomic(t.path, r.fixed)
            except OSError as exc:
                # the file is as it was: report what is in it, not what the fixes left
                settings = resolver.for_file(t.path, t.config)
                r = _work((r.path, str(t.path), dataclasses.replace(settings, fix=None)))  # nothing applied
                r.diagnostics.append(diag_at(r.path, READ_ERROR, 1, 1, f"cannot write the fixed file: {exc.strerror}"))
                r.diagnostics.sort()
                write_failed = True
        if cache is not None and r.path in keys and r.fixed is None and not r.internal_error and not write_failed:
            cache.put(str(t.path), keys[r.path], [d.to_cache_dict() for d in r.diagnostics])
        out.results.append(r)
    if cache is not None:
        cache.save()
    out.results.sort(key=lambda r: r.path)
    if referenced_only:
        _drop_unreferenced(out, targets)
    return out


def _drop_unreferenced(out: RunResult, targets: Sequence[Target]) -> None:
    from ampdoctor.lint import project

    diags = [d for r in out.results for d in r.diagnostics]
    kept, hidden = project.split_unreferenced(diags, {t.display: t.path for t in targets},
                                              [t.path for t in targets])
    if not hidden:
        return
    keep = {id(d) for d in kept}
    for r in out.results:
        r.diagnostics = [d for d in r.diagnostics if id(d) in keep]
    out.unreferenced = hidden


def _from_cache(hit: list, display: str) -> list[Diagnostic] | None:
    """A cache entry's diagnostics, or None when the entry is damaged (it is then linted again).

    The entry was written from wherever that run started: its paths are made this run's."""
    try:
        diags = [Diagnostic.from_dict(d) for d in hit]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    for d in diags:
        if not (type(d.line) is int and type(d.column) is int and type(d.end_line) is int
                and type(d.end_column) is int and d.line >= 1 and d.column >= 1
                and all(isinstance(v, str) for v in (d.path, d.code, d.name, d.message))
                and (d.fix_title is None or isinstance(d.fix_title, str))):
            return None
    return [d if d.path == display else dataclasses.replace(d, path=display) for d in diags]


@contextlib.contextmanager
def _rare_collections():
    """Run Python's cyclic garbage collector rarely while linting.

    A parse makes hundreds of thousands of small objects, which reference counting frees; at the
    default thresholds the collector still walks the young ones every 700 allocations, which
    costs a third of the run. The objects alive before the run (the imported modules) are frozen
    out of the collector's walks too; forked workers inherit both settings."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def _execute(todo: list[tuple[str, str, Settings]], jobs: int | None, progress) -> list[FileResult]:
    with _rare_collections():
        return _execute_all(todo, jobs, progress)


def _execute_all(todo: list[tuple[str, str, Settings]], jobs: int | None, progress) -> list[FileResult]:
    jobs = jobs or os.cpu_count() or 1
    if jobs <= 1 or len(todo) < POOL_MIN_FILES:
        results = []
        for item in todo:
            results.append(_work(item))
            if progress:
                progress(1)
        return results
    # larger files first so the pool ends evenly; chunks keep pickling overhead low
    todo = sorted(todo, key=lambda i: -_size(i[1]))
    chunk = max(1, min(16, len(todo) // (jobs * 8)))
    chunks = [todo[i:i + chunk] for i in range(0, len(todo), chunk)]
    method = "fork" if sys.platform.startswith("linux") else None
    ctx = multiprocessing.get_context(method)
    results: list[FileResult] = []
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        for batch in pool.map(_work_chunk, chunks):
            results.extend(batch)
            if progress:
                progress(len(batch))
    return results


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def lint_stdin(display: str, data: bytes, settings: Settings) -> RunResult:
    from ampdoctor.lint.engine import lint_bytes

    r = lint_bytes(display, data, settings)
    return RunResult([r], files=1)
