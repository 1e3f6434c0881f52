"""``[tool.ampdoctor]`` discovery and validation (stdlib only).

Keys (all optional)::

    [tool.ampdoctor]
    select = ["AMP1", "AMP401"]      # codes or prefixes; replaces the default set
    extend-select = ["AMP003"]       # added to the set
    ignore = ["AMP4"]                # removed from the set
    exclude = ["legacy/"]            # gitignore-style patterns, replace the default excludes
    extend-exclude = ["gen_*.py"]    # added to the excludes
    per-file-ignores = {"tests/*" = ["AMP401"]}
    min-torch-version = "2.4"        # oldest torch the project supports; gates fixes

The nearest ``pyproject.toml`` with a ``[tool.ampdoctor]`` table, walking up from the
linted path, applies. Patterns are relative to that file's folder.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ampdoctor.diagnostics import AmpdoctorError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_EXCLUDE = (
    ".git", ".hg", ".svn", ".bzr", ".venv", "venv", ".tox", ".nox", ".eggs", "__pycache__",
    "build", "dist", "_build", "buck-out", "node_modules", "site-packages", ".mypy_cache",
    ".pytest_cache", ".ruff_cache", ".ampdoctor_cache", ".ipynb_checkpoints", ".direnv",
    "__pypackages__", ".hypothesis",
)

_KEYS = {"select", "extend-select", "ignore", "exclude", "extend-exclude", "per-file-ignores",
         "min-torch-version", "include-unreferenced"}
_VERSION = re.compile(r"^\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?\s*$")


@dataclass(frozen=True)
class Config:
    root: Path  # folder the patterns are relative to
    source: Path | None = None  # the pyproject.toml it came from
    select: tuple[str, ...] | None = None
    extend_select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] | None = None
    extend_exclude: tuple[str, ...] = ()
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()
    min_torch_version: tuple[int, ...] | None = None
    include_unreferenced: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)


def parse_version(value: str, where: str) -> tuple[int, ...]:
    m = _VERSION.match(str(value))
    if not m:
        raise AmpdoctorError(f"{where}: min-torch-version must look like \"2.4\", got {value!r}")
    return tuple(int(g) for g in m.groups() if g is not None)


def _str_list(value, key: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise AmpdoctorError(f"{where}: '{key}' must be a list of strings, e.g. {key} = [{_toml_str(value)}], "
                             f"not the string {_toml_str(value)}")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AmpdoctorError(f"{where}: '{key}' must be a list of strings, got {_toml_value(value)}")
    return tuple(value)


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_value(v) -> str:
    """A value as the user wrote it in TOML (not as Python prints it)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


def from_table(table: dict, root: Path, source: Path | None) -> Config:
    where = str(source) if source else "[tool.ampdoctor]"
    if not isinstance(table, dict):
        raise AmpdoctorError(f"{where}: [tool.ampdoctor] must be a table")
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise AmpdoctorError(f"{where}: unknown key '{unknown[0]}' in [tool.ampdoctor] "
                             f"(known: {', '.join(sorted(_KEYS))})")
    pfi = table.get("per-file-ignores", {})
    if not isinstance(pfi, dict):
        raise AmpdoctorError(f"{where}: 'per-file-ignores' must be a table of pattern = [codes]")
    mtv = table.get("min-torch-version")
    if mtv is not None and not isinstance(mtv, str):
        # an unquoted 2.10 is the TOML float 2.1: a number would silently name another version
        raise AmpdoctorError(f"{where}: 'min-torch-version' must be a quoted string such as \"2.4\", "
                             f"got the {type(mtv).__name__} {_toml_value(mtv)} (quote it: an unquoted 2.10 reads as 2.1)")
    unref = table.get("include-unreferenced", False)
    if not isinstance(unref, bool):
        raise AmpdoctorError(f"{where}: 'include-unreferenced' must be true or false, got {_toml_value(unref)}")
    return Config(
        root=root,
        source=source,
        select=_str_list(table["select"], "select", where) if "select" in table else None,
        extend_select=_str_list(table.get("extend-select", []), "extend-select", where),
        ignore=_str_list(table.get("ignore", []), "ignore", where),
        exclude=_str_list(table["exclude"], "exclude", where) if "exclude" in table else None,
        extend_exclude=_str_list(table.get("extend-exclude", []), "extend-exclude", where),
        per_file_ignores=tuple(sorted((k, _str_list(v, f"per-file-ignores.{k}", where)) for k, v in pfi.items())),
        min_torch_version=parse_version(mtv, where) if mtv is not None else None,
        include_unreferenced=unref,
    )


def load(path: Path) -> Config:
    """Load ``[tool.ampdoctor]`` from a pyproject.toml (an empty config if the table is absent)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise AmpdoctorError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise AmpdoctorError(f"{path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise AmpdoctorError(f"{path}: invalid TOML: the file is not UTF-8") from None
    table = data.get("tool", {}).get("ampdoctor", {}) if isinstance(data.get("tool"), dict) else {}
    return from_table(table, path.parent.resolve(), path)


def _has_table(path: Path) -> bool:
    try:
        raw = path.read_bytes()
    except OSError:
        return False
    if b"ampdoctor" not in raw:
        return False
    try:
        data = tomllib.loads(raw.decode("utf-8", "replace"))
    except tomllib.TOMLDecodeError:
        return True  # let load() report the error
    tool = data.get("tool")
    return isinstance(tool, dict) and "ampdoctor" in tool


class Finder:
    """Finds the config that applies to a folder, walking up; memoised per folder."""

    def __init__(self, fallback_root: Path) -> None:
        self.fallback = Config(root=fallback_root.resolve())
        self._memo: dict[str, Config] = {}

    def for_dir(self, directory: Path) -> Config:
        key = os.fspath(directory)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        candidate = directory / "pyproject.toml"
        if candidate.is_file() and _has_table(candidate):
            cfg = load(candidate)
        elif directory.parent == directory:
            cfg = self.fallback
        else:
            cfg = self.for_dir(directory.parent)
        self._memo[key] = cfg
        return cfg
