"""The file's call graph: which function of the file a call reaches, and who calls each one.

Resolved calls: ``helper(...)`` to a module-level def, ``self.m(...)``/``cls.m(...)`` to a method
of the enclosing class or of an in-file base class, ``super().m(...)`` to the base's method,
and ``Class.m(...)``. Anything else (a method of another object, a callable passed in) is left
unresolved: the graph never guesses. Each call site also records the autocast regions written
around it in its own function, which is what ``inherited_region`` builds on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from ampdoctor.lint import tree
from ampdoctor.lint.helpers import epoch_loop
from ampdoctor.lint.names import Names, dotted_name
from ampdoctor.lint.semantic.autocast import Region, autocast_call


_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


@dataclass(eq=False)
class Function:
    node: cst.FunctionDef
    name: str
    cls: "Klass | None"
    sites: list["CallSite"] = field(default_factory=list)  # where the file calls it
    calls: list["CallSite"] = field(default_factory=list)  # the resolved calls it makes

    @property
    def qualname(self) -> str:
        return f"{self.cls.name}.{self.name}" if self.cls is not None else self.name


@dataclass(eq=False)
class Klass:
    node: cst.ClassDef
    name: str
    bases: list[str]
    methods: dict[str, Function] = field(default_factory=dict)


@dataclass(eq=False)
class CallSite:
    call: cst.Call
    caller: Function | None  # None at module level
    regions: list[Region]  # autocast regions written around the call in the caller, innermost first
    callee: Function | None = None


class CallGraph:
    def __init__(self, module: cst.Module) -> None:
        self.names = Names()  # the whole file's imports and aliases, in source order
        self.functions: dict[int, Function] = {}
        self.module_functions: dict[str, Function] = {}
        self.classes: dict[str, Klass] = {}
        self.sites: list[CallSite] = []
        self._pending: list[tuple[CallSite, Klass | None]] = []
        self._walk(module)
        self._by_call: dict[int, CallSite] = {}
        for site, klass in self._pending:
            self._by_call[id(site.call)] = site
            site.callee = self._resolve(site.call, klass)
            if site.callee is not None:
                site.callee.sites.append(site)
                if site.caller is not None:
                    site.caller.calls.append(site)
        del self._pending

    # -- building ------------------------------------------------------------------------
    def _walk(self, module: cst.Module) -> None:
        names = self.names
        # (node, leaving, class, function, autocast regions open around it in its function)
        stack: list = [(module, False, None, None, ())]
        while stack:
            node, leaving, klass, fn, regions = stack.pop()
            t = type(node)
            if leaving:
                if t is cst.Assign:
                    names.add_assign([a.target for a in node.targets], node.value)
                elif t is cst.AnnAssign and node.value is not None:
                    names.add_assign([node.target], node.value)
                continue
            if t is cst.Import:
                names.add_import(node, fn is None and klass is None)
            elif t is cst.ImportFrom:
                names.add_import_from(node, fn is None and klass is None)
            elif t is cst.Assign or t is cst.AnnAssign:
                stack.append((node, True, klass, fn, regions))
            elif t is cst.ClassDef:
                bases = [dotted_name(a.value) or "" for a in node.bases]
                k = Klass(node, node.name.value, [b for b in bases if b])
                if fn is None and klass is None:
                    self.classes.setdefault(k.name, k)
                for child in reversed(node.body.body):
                    stack.append((child, False, k, None, ()))
                continue
            elif t is cst.FunctionDef:
                f = Function(node, node.name.value, klass)
                self.functions[id(node)] = f
                if klass is not None and fn is None:
                    klass.methods.setdefault(f.name, f)
                elif klass is None and fn is None:
                    self.module_functions.setdefault(f.name, f)
                inner: list[Region] = []
                for d in node.decorators:
                    ac = autocast_call(names, d.decorator)
                    if ac is not None:
                        inner.append(Region(ac, node))
                for d in reversed(node.decorators):
                    stack.append((d, False, klass, fn, regions))
                stack.append((node.body, False, klass, f, tuple(inner)))
                continue
            elif t is cst.Lambda:
                continue  # its calls run when the lambda is called, somewhere else
            elif t is cst.With:
                opened = [Region(ac, node) for item in node.items
                          if (ac := autocast_call(names, item.item)) is not None]
                for item in reversed(node.items):
                    stack.append((item, False, klass, fn, regions))
                stack.append((node.body, False, klass, fn, tuple(reversed(opened)) + regions if opened else regions))
                continue
            elif t is cst.Call:
                site = CallSite(node, fn, list(regions))
                self.sites.append(site)
                self._pending.append((site, klass))
            for child in reversed(tree.children(node)):
                stack.append((child, False, klass, fn, regions))

    def _method(self, klass: Klass | None, name: str, seen: set[str] | None = None) -> Function | None:
        """``name`` looked up on ``klass`` and its in-file bases (depth first, like a simple MRO)."""
        if klass is None:
            return None
        if name in klass.methods:
            return klass.methods[name]
        seen = seen or set()
        seen.add(klass.name)
        for b in klass.bases:
            base = self.classes.get(b.rsplit(".", 1)[-1])
            if base is not None and base.name not in seen:
                found = self._method(base, name, seen)
                if found is not None:
                    return found
        return None

    def _resolve(self, call: cst.Call, klass: Klass | None) -> Function | None:
        func = call.func
        if isinstance(func, cst.Name):
            return self.module_functions.get(func.value)
        if not isinstance(func, cst.Attribute):
            return None
        recv, name = func.value, func.attr.value
        if isinstance(recv, cst.Name) and recv.value in ("self", "cls"):
            return self._method(klass, name)
        if isinstance(recv, cst.Call) and isinstance(recv.func, cst.Name) and recv.func.value == "super" \
                and klass is not None:
            for b in klass.bases:
                base = self.classes.get(b.rsplit(".", 1)[-1])
                found = self._method(base, name) if base is not None else None
                if found is not None:
                    return found
            return None
        if isinstance(recv, cst.Name) and recv.value in self.classes:
            return self._method(self.classes[recv.value], name)
        return None

    # -- queries -------------------------------------------------------------------------
    def function(self, node: cst.FunctionDef) -> Function | None:
        return self.functions.get(id(node))

    def callee(self, call: cst.Call) -> Function | None:
        """The function of this file that ``call`` runs, when the graph resolves it."""
        site = self._by_call.get(id(call))
        return site.callee if site is not None else None

    def base_method(self, fn: Function) -> Function | None:
        """The in-file base-class method that ``fn`` overrides."""
        if fn.cls is None:
            return None
        for b in fn.cls.bases:
            base = self.classes.get(b.rsplit(".", 1)[-1])
            found = self._method(base, fn.name, {fn.cls.name}) if base is not None else None
            if found is not None:
                return found
        return None

    def loop_caller(self, node: cst.FunctionDef, loop_filter=None) -> "tuple[Function, cst.CSTNode] | None":
        """An in-file caller that calls ``node`` inside one of its loops (and that loop), when one
        does; with ``loop_filter``, only loops it accepts."""
        fn = self.functions.get(id(node))
        if fn is None:
            return None
        for site in fn.sites:
            caller = site.caller
            if caller is None or caller.node is node:
                continue
            for n in tree.walk(caller.node.body, skip=_SCOPES):
                if isinstance(n, (cst.For, cst.While)) and any(m is site.call for m in tree.walk(n.body, skip=_SCOPES)) \
                        and (loop_filter is None or loop_filter(n)):
                    return caller, n
        return None

    @staticmethod
    def loops_itself(node: cst.FunctionDef, name: str | None = None, loop_filter=None) -> bool:
        """``node`` has a loop of its own (one that reads ``name``, when given; with
        ``loop_filter``, one it accepts): it is one epoch over the batches, not one step."""
        for n in tree.walk(node.body, skip=_SCOPES):
            if isinstance(n, (cst.For, cst.While)) and (loop_filter is None or loop_filter(n)) and (name is None or any(
                    isinstance(m, cst.Name) and m.value == name for m in tree.walk(n.body, skip=_SCOPES))):
                return True
        return False

    def run_anew(self, node: cst.FunctionDef, name: str | None = None) -> "tuple[Function, cst.CSTNode] | None":
        """The caller that runs ``node`` again and again, and its loop: any loop when ``node`` is
        one step, an epoch loop when ``node`` is one epoch (``loops_itself``). State local to
        ``node`` (a GradScaler) then lives for one step or epoch. A ``node`` with an epoch loop of
        its own is a whole training run (atlas's ``train()`` called once per target dataset): None."""
        if not self.loops_itself(node, name):
            return self.loop_caller(node)
        if self.loops_itself(node, name, epoch_loop):
            return None
        return self.loop_caller(node, epoch_loop)

    def inherited_region(self, node: cst.FunctionDef, _seen: set[int] | None = None) -> Region | None:
        """The autocast region ``node`` runs in when every in-file call of it is inside one
        (written around the call, or itself inherited by the caller), else None. The region's
        ``via`` is the first such call. A function never called in the file inherits nothing."""
        fn = self.functions.get(id(node))
        if fn is None or not fn.sites:
            return None
        seen = _seen if _seen is not None else set()
        if id(node) in seen:
            return None
        seen.add(id(node))
        found: Region | None = None
        for site in fn.sites:
            region = site.regions[0] if site.regions else None
            if region is None and site.caller is not None:
                region = self.inherited_region(site.caller.node, seen)
            if region is None or region.ac.enabled is False:
                return None
            if found is None:
                found = Region(region.ac, region.node, region.via or site.call)
        return found
