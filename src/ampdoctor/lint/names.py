"""A small import-alias resolver.

libcst's ScopeProvider/QualifiedNameProvider cost several times the parse, so the
linter keeps its own table instead: it is filled while the single traversal walks the
file, in source order, from ``import``/``from ... import`` statements at any depth and
from simple assignments (``ac = functools.partial(torch.autocast, "cuda")``,
``self.scaler = GradScaler()``). Scoping is deliberately flat: a name imported inside
one function is visible to later code elsewhere in the file, which is what real
training scripts need and costs nothing.
"""

from __future__ import annotations

import libcst as cst

_PARTIALS = {"functools.partial", "partial"}


def dotted_name(node: cst.CSTNode | None) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name):
        parts.append(node.value)
        return ".".join(reversed(parts))
    return None


def _module_name(node: cst.BaseExpression | None) -> str:
    return dotted_name(node) or ""


class Names:
    """Alias table: local name -> fully qualified name."""

    __slots__ = ("aliases", "assigned", "partials", "module_level_imports", "dotted_aliases", "_bound",
                 "reimported")

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}
        # dotted target ("scaler", "self.scaler") -> qualified name of the call that made it
        self.assigned: dict[str, str] = {}
        # name -> the functools.partial(...) call it was bound to
        self.partials: dict[str, cst.Call] = {}
        # top-level "import torch" style bindings: local name -> module
        self.module_level_imports: dict[str, str] = {}
        # whether some alias key is dotted (``self.autocast``): only then are chains looked up whole
        self.dotted_aliases = False
        # dotted target -> the names it was bound to by plain assignments ("" for anything else):
        # a name bound to different things (`dtype = torch.float16` / `dtype = torch.bfloat16` in
        # the arms of an if) is no alias of either
        self._bound: dict[tuple[int, str], set[str]] = {}  # keyed by (function id, target)
        # local names imported from more than one place (``try: from torch.amp import GradScaler /
        # except ImportError: from torch.cuda.amp import GradScaler``): which one holds depends on
        # the installed version; ``aliases`` keeps the last
        self.reimported: set[str] = set()

    # -- filling ---------------------------------------------------------------
    def add_import(self, node: cst.Import, top_level: bool) -> None:
        for alias in node.names:
            full = _module_name(alias.name)
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                local = alias.asname.name.value
                self.aliases[local] = full
            else:
                local = full.split(".", 1)[0]
                self.aliases[local] = local
            if top_level:
                self.module_level_imports[local] = self.aliases[local]

    def add_import_from(self, node: cst.ImportFrom, top_level: bool) -> None:
        if isinstance(node.names, cst.ImportStar):
            return
        module = "." * len(node.relative) + _module_name(node.module)
        for alias in node.names:
            name = _module_name(alias.name)
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                local = alias.asname.name.value
            else:
                local = name
            full = f"{module}.{name}" if module else name
            if self.aliases.get(local, full) != full:
                self.reimported.add(local)
            self.aliases[local] = full
            if top_level:
                self.module_level_imports[local] = full

    def add_assign(self, targets: list[cst.BaseExpression], value: cst.BaseExpression, scope: int = 0) -> None:
        if not isinstance(value, cst.Call):
            # `ac = torch.autocast` style re-binding of a callable
            q = self.qualified(value) if isinstance(value, (cst.Name, cst.Attribute)) else None
            imported = q is not None and self._imported_base(value)
            for t in targets:
                d = dotted_name(t)
                if d is None:
                    continue
                self.assigned.pop(d, None)
                seen = self._bound.setdefault((scope, d), set())
                seen.add(q or "")
                if len(seen) > 1:  # bound to different values: which one holds depends on the path
                    self.aliases.pop(d, None)
                    self.partials.pop(d, None)
                    continue
                if q is not None and q != d and "." in q and (isinstance(t, cst.Name) or imported):
                    # `ac = torch.cuda.amp.autocast`, `self.ac = amp.autocast` (not `self.m = model.module`)
                    self.aliases[d] = q
                    self.dotted_aliases = self.dotted_aliases or "." in d
                    if q in self.partials:
                        self.partials[d] = self.partials[q]
                    else:
                        self.partials.pop(d, None)
                else:  # rebound to something else: the old alias no longer holds
                    self.aliases.pop(d, None)
                    self.partials.pop(d, None)
            return
        callee = self.qualified(value.func)
        for t in targets:
            d = dotted_name(t)
            if d is None:
                continue
            self.aliases.pop(d, None)
            self.partials.pop(d, None)
            seen = self._bound.setdefault((scope, d), set())
            seen.add("()" + (callee or ""))
            if callee in _PARTIALS and value.args and len(seen) == 1:
                inner = self.qualified(value.args[0].value)
                if inner:  # `ac = partial(torch.autocast, "cuda")`, `self.ac = partial(...)`
                    self.aliases[d] = inner
                    self.partials[d] = value
                    self.dotted_aliases = self.dotted_aliases or "." in d
                    continue
            if callee is not None:
                self.assigned[d] = callee

    def _imported_base(self, node: cst.CSTNode) -> bool:
        while isinstance(node, cst.Attribute):
            node = node.value
        return isinstance(node, cst.Name) and node.value in self.aliases and "." not in node.value

    # -- queries ----------------------------------------------------------------
    def qualified(self, node: cst.CSTNode | None) -> str | None:
        """The qualified name an expression refers to, or None when it is not a name chain.

        Unknown base names resolve to themselves (``float`` -> ``float``).
        """
        parts: list[str] = []
        while isinstance(node, cst.Attribute):
            parts.append(node.attr.value)
            node = node.value
        if not isinstance(node, cst.Name):
            return None
        if parts and self.dotted_aliases:
            full = node.value + "." + ".".join(reversed(parts))
            if full in self.aliases:  # `self.amp_autocast` bound to an alias
                return self.aliases[full]
        base = self.aliases.get(node.value, node.value)
        if parts:
            return base + "." + ".".join(reversed(parts))
        return base

    def call_name(self, call: cst.Call) -> str | None:
        return self.qualified(call.func)

    def made_by(self, node: cst.CSTNode) -> str | None:
        """Qualified name of the call whose result was assigned to this name/attribute."""
        d = dotted_name(node)
        return self.assigned.get(d) if d else None

    def local_name_for(self, module: str) -> str | None:
        """The top-level local name bound to ``module`` (``import torch as t`` -> ``t``)."""
        for local, full in sorted(self.module_level_imports.items()):
            if full == module:
                return local
        return None
