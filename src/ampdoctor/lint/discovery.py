"""Which files to lint: walk the given paths, honour .gitignore and the exclude settings."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pathspec

from ampdoctor.config import DEFAULT_EXCLUDE, Config, Finder

SUFFIXES = (".py", ".pyi")


@dataclass(frozen=True)
class Target:
    path: Path  # absolute
    display: str  # what users see: relative to the current folder when below it
    config: Config


@dataclass(frozen=True)
class ExcludeOptions:
    exclude: tuple[str, ...] | None = None  # from the command line: replaces config + defaults
    extend_exclude: tuple[str, ...] = ()
    force_exclude: bool = False
    respect_gitignore: bool = True


def display_path(path: Path, cwd: Path) -> str:
    try:
        return path.relative_to(cwd).as_posix()
    except ValueError:
        return path.as_posix()


@lru_cache(maxsize=256)
def _spec(patterns: tuple[str, ...]) -> pathspec.PathSpec:
    return pathspec.GitIgnoreSpec.from_lines(patterns)


def _exclude_spec(cfg: Config, opts: ExcludeOptions) -> pathspec.PathSpec:
    if opts.exclude is not None:
        base = opts.exclude
    elif cfg.exclude is not None:
        base = cfg.exclude
    else:
        base = DEFAULT_EXCLUDE
    return _spec(tuple(base) + tuple(cfg.extend_exclude) + tuple(opts.extend_exclude))


def _rel(path: Path, root: Path) -> str | None:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return None


def is_excluded(path: Path, cfg: Config, opts: ExcludeOptions, is_dir: bool, base: Path | None = None) -> bool:
    """Whether the excludes match ``path``, taken relative to ``base`` (default: the config's folder)."""
    spec = _exclude_spec(cfg, opts)
    rel = _rel(path, base or cfg.root)
    if rel is None or rel == ".":
        rel = path.name
    return spec.match_file(rel + "/" if is_dir else rel)


class _GitIgnores:
    """.gitignore files from the repository root down to each folder walked."""

    def __init__(self) -> None:
        self._per_dir: dict[Path, list[tuple[Path, pathspec.PathSpec]]] = {}

    @staticmethod
    def _repo_root(directory: Path) -> Path | None:
        for d in (directory, *directory.parents):
            if (d / ".git").exists():
                return d
        return None

    def _load(self, directory: Path, extra: Path | None = None) -> list[tuple[Path, pathspec.PathSpec]]:
        out = []
        for f in (directory / ".gitignore", extra):
            if f is None:
                continue
            try:  # not waiting on a FIFO, not reading a device
                fd = os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
                with open(fd, "rb") as fh:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        continue
                    lines = fh.read().decode("utf-8", "replace").splitlines()
            except OSError:
                continue
            out.append((directory, pathspec.GitIgnoreSpec.from_lines(lines)))
        return out

    def specs(self, directory: Path) -> list[tuple[Path, pathspec.PathSpec]]:
        hit = self._per_dir.get(directory)
        if hit is not None:
            return hit
        root = self._repo_root(directory)
        if root is None:
            specs: list = []
        elif directory == root:
            specs = self._load(directory, root / ".git" / "info" / "exclude")
        else:
            specs = self.specs(directory.parent) + self._load(directory)
        self._per_dir[directory] = specs
        return specs

    def ignored(self, path: Path, is_dir: bool, floor: Path | None = None) -> bool:
        """Whether git ignores ``path``; with ``floor``, only .gitignore files at or below it count."""
        for base, spec in self.specs(path.parent):
            if floor is not None and _rel(base, floor) is None:
                continue
            rel = _rel(path, base)
            if rel and spec.match_file(rel + "/" if is_dir else rel):
                return True
        return False


def discover(paths: list[str], finder: Finder, opts: ExcludeOptions, cwd: Path) -> tuple[list[Target], list[str]]:
    """The files to lint and the paths that could not be used (one message each)."""
    gitignores = _GitIgnores()
    targets: dict[Path, Target] = {}
    problems: list[str] = []

    cwd_str = str(cwd)

    def add(p: Path, cfg: Config | None = None) -> None:
        if cfg is None:
            cfg = finder.for_dir(p.parent)
        s = str(p)
        display = _rel_str(s, cwd_str) or p.as_posix()
        targets.setdefault(p, Target(p, display, cfg))

    for raw in paths:
        p = Path(os.path.abspath(os.path.join(cwd, raw)))
        if p.is_symlink() and not p.exists():
            add(p)  # a broken link named explicitly: reading it reports the problem
            continue
        if not p.exists():
            problems.append(f"{raw}: no such file or directory")
            continue
        if p.is_file():
            if opts.force_exclude:
                cfg = finder.for_dir(p.parent)
                if _named_excluded(p, cfg, opts) or \
                        (opts.respect_gitignore and gitignores.ignored(p, False)):
                    continue
            add(p)
            continue
        if not p.is_dir():
            problems.append(f"{raw}: not a regular file or folder")
            continue
        _walk(p, finder, opts, gitignores, add, problems, raw)
    return sorted(targets.values(), key=lambda t: t.display), problems


def _named_excluded(p: Path, cfg: Config, opts: ExcludeOptions) -> bool:
    """Whether a path named on the command line, or a folder above it, is excluded."""
    return any(is_excluded(q, cfg, opts, q != p or p.is_dir()) for q in (p, *p.parents)
               if _rel(q, cfg.root) not in (None, "."))


def _rel_str(path: str, base: str) -> str | None:
    if path.startswith(base) and len(path) > len(base) and path[len(base)] == os.sep:
        return path[len(base) + 1:].replace(os.sep, "/")
    return None


def _walk(top: Path, finder: Finder, opts: ExcludeOptions, gitignores: _GitIgnores, add, problems, raw) -> None:
    # A folder named on the command line is linted even when the excludes cover it; the
    # excludes then apply to what lies below it, matched from that folder.
    base = top if _named_excluded(top, finder.for_dir(top), opts) else None
    # likewise a folder that git ignores (say, a package inside .venv/) is linted when named
    floor = top if opts.respect_gitignore and any(
        gitignores.ignored(q, True) for q in (top, *top.parents) if q.parent != q) else None
    floor_str = str(floor) if floor is not None else None
    stack = [str(top)]
    while stack:
        d = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            problems.append(f"{display_path(Path(d), Path.cwd()) if d != str(top) else raw}: "
                            f"cannot list folder ({exc.strerror})")
            continue
        dpath = Path(d)
        cfg = finder.for_dir(dpath)
        spec = _exclude_spec(cfg, opts)
        ex_base = str(base or cfg.root)
        ignores = []
        if opts.respect_gitignore:
            ignores = [(str(b), gs) for b, gs in gitignores.specs(dpath)
                       if floor_str is None or str(b) == floor_str or str(b).startswith(floor_str + os.sep)]

        def excluded(path: str, name: str, is_dir: bool) -> bool:
            rel = _rel_str(path, ex_base) or name
            if spec.match_file(rel + "/" if is_dir else rel):
                return True
            for b, gs in ignores:
                r = _rel_str(path, b)
                if r and gs.match_file(r + "/" if is_dir else r):
                    return True
            return False

        subdirs = []
        for e in entries:
            try:
                is_link = e.is_symlink()
                is_dir = e.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                if excluded(e.path, e.name, True) or os.path.exists(os.path.join(e.path, "pyvenv.cfg")):
                    continue
                subdirs.append(e.path)
            elif e.name.endswith(SUFFIXES):
                try:
                    link_to_dir = is_link and e.is_dir()
                    regular = e.is_file()
                except OSError:  # a symlink loop: reading it reports the problem
                    link_to_dir = regular = False
                if link_to_dir:
                    continue  # never follow links to folders (loops)
                if not regular and (not is_link or os.path.exists(e.path)):
                    continue  # a FIFO, socket or device: reading it would block or never end
                if excluded(e.path, e.name, False):
                    continue
                add(Path(e.path), cfg)
        stack.extend(reversed(subdirs))
