"""The lint cache: one JSON file per settings fingerprint, mapping a file to its results.

An entry is valid only for the exact file content (blake2b), enabled codes, settings and
ampdoctor version. The file is written atomically (temporary file + rename), so two
processes sharing the cache never corrupt it: the last writer wins. A damaged or
foreign cache file is ignored and rewritten. The cache never writes through symlinks.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from ampdoctor import __version__

CACHE_DIR_NAME = ".ampdoctor_cache"
_FORMAT = 3


def content_key(data: bytes, settings_key: str) -> str:
    h = hashlib.blake2b(data, digest_size=16)
    h.update(settings_key.encode())
    return h.hexdigest()


def settings_key(enabled: frozenset[str], min_torch, rules_fingerprint: str) -> str:
    raw = json.dumps([__version__, _FORMAT, sorted(enabled), list(min_torch or ()), rules_fingerprint])
    return hashlib.blake2b(raw.encode(), digest_size=12).hexdigest()


class Cache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.file = directory / f"v{_FORMAT}-{__version__}.json"
        self.entries: dict[str, list] = {}
        self.dirty = False
        self.usable = self._safe_dir()
        if self.usable:
            self._read()

    def _safe_dir(self) -> bool:
        d = self.directory
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            return False
        return not self.file.is_symlink()

    def _read(self) -> None:
        try:
            with open(self.file, "rb") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return
        if isinstance(data, dict) and data.get("version") == __version__ and isinstance(data.get("files"), dict):
            self.entries = data["files"]

    def get(self, path: str, key: str) -> list | None:
        hit = self.entries.get(path)
        if isinstance(hit, list) and len(hit) == 2 and hit[0] == key and isinstance(hit[1], list):
            return hit[1]
        return None

    def put(self, path: str, key: str, diagnostics: list[dict]) -> None:
        self.entries[path] = [key, diagnostics]
        self.dirty = True

    def save(self) -> None:
        if not (self.dirty and self.usable):
            return
        try:
            if not self.directory.exists():
                self.directory.mkdir(parents=True)
                (self.directory / ".gitignore").write_text("# created by ampdoctor\n*\n")
                (self.directory / "CACHEDIR.TAG").write_text(
                    "Signature: 8a477f597d28d172789f06886806bc55\n# ampdoctor cache\n")
            if not self._safe_dir():
                return
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": __version__, "files": self.entries}, f, separators=(",", ":"))
                os.replace(tmp, self.file)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError:
            pass  # a read-only checkout: linting still works, just without a cache
