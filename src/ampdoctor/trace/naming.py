"""Module and parameter names that do not depend on which module ran first.

Every module the tracer sees gets a small integer key at its first call. Names are resolved
later, from the module trees the script holds: its globals, the local variables of the frames
that are running when a step ends (a training loop inside ``main()``), the objects reachable
from those (``trainer.model``, a ``ModuleDict``, a list of models) and the modules seen. Each
module is named by its dotted path inside the largest tree that contains it. When the script
holds several independent models (a GAN's generator and discriminator), each gets its variable
name as a prefix (``G.main.0``, ``D.main.0``). A module that no tree contains (one built inside
``forward``, such as ``nn.Softmax(dim=-1)(x)``) is folded into one entry named by the module
whose ``forward`` called it and its class (``h.0.attn.(Softmax)``), so a module made on every
call does not add a row on every call.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import types
import weakref
from dataclasses import dataclass

import torch

# frames whose locals are never the script's: torch, ampdoctor, the standard library, pytest
_SKIP_DIRS = tuple(d + os.sep for d in {os.path.dirname(torch.__file__),
                                        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                        sysconfig.get_paths()["stdlib"]} if d)
_IGNORED = re.compile(r"[\\/](_pytest|pluggy|pytest)[\\/]")
_LEAF_TYPES = (str, bytes, int, float, bool, complex, type, types.ModuleType, types.FunctionType,
               types.BuiltinFunctionType, types.MethodType, weakref.ref, torch.Tensor, torch.dtype, torch.device,
               range, slice, type(None))
SEARCH_BUDGET = 20_000  # objects looked at per resolution
SEARCH_DEPTH = 3  # attribute / item hops from a variable (trainer.model, self.models[0])


@dataclass(eq=False)
class Tree:
    """A module tree found in the script: its root, the variable that holds it, and its size."""

    tid: int
    cls: str
    label: str | None  # how the script reaches it ("model", "trainer.model"), if it was found
    size: int
    ref: "weakref.ref | None" = None
    prefix: str = ""  # set by Namer.names()


@dataclass(eq=False)
class Mod:
    """One module seen by the tracer, or a group of modules built inside a forward."""

    key: int
    cls: str
    parent: int | None  # the key of the module running when it was first called
    ref: "weakref.ref | None" = None  # None for a group
    tree: Tree | None = None
    path: str = ""
    group: bool = False


class Namer:
    """Keys for modules at call time; names for keys when the report is built."""

    def __init__(self) -> None:
        self.mods: dict[int, Mod] = {}
        self.alias: dict[int, int] = {}  # a key folded into a group -> the group's key
        self._by_id: dict[int, tuple] = {}  # id(module) -> (weakref, key)
        self._groups: dict[tuple, int] = {}  # (parent key, class) -> group key
        self._known: dict[int, tuple] = {}  # id(module) -> (weakref, tree, path) from the last resolution
        self._trees: dict[int, Tree] = {}  # id(root) -> tree
        self.unresolved: set[int] = set()
        self._params: dict[int, tuple] = {}  # id(param) -> (weakref, pkey)
        self._param_at: dict[int, tuple] = {}  # pkey -> (tree, dotted name)
        self._param_unresolved: set[int] = set()
        self._param_label: dict[int, str] = {}  # pkey -> the variable holding a parameter no module owns
        self._next = 0
        self._pnext = 0

    # -- call time ---------------------------------------------------------------------------
    def key(self, module: torch.nn.Module, parent: int | None) -> int:
        hit = self._by_id.get(id(module))
        if hit is not None and hit[0]() is module:
            return hit[1]
        return self._new(module, parent)

    def _new(self, module, parent: int | None) -> int:
        cls = type(module).__name__
        known = self._known.get(id(module))
        if known is not None and known[0]() is not module:
            known = None
        if known is None:
            group = self._groups.get((parent, cls))
            if group is not None:  # another module built in the same forward: fold it in at once
                self._remember(module, group)
                return group
        key = self._next
        self._next += 1
        m = self.mods[key] = Mod(key, cls, parent, self._remember(module, key))
        if known is not None:
            m.tree, m.path = known[1], known[2]
        else:
            self.unresolved.add(key)
        return key

    def _remember(self, module, key: int):
        mid, by_id = id(module), self._by_id
        ref = weakref.ref(module, lambda r, mid=mid: _forget(by_id, mid, r))
        by_id[mid] = (ref, key)
        return ref

    def param_key(self, p: torch.Tensor) -> int:
        hit = self._params.get(id(p))
        if hit is not None and hit[0]() is p:
            return hit[1]
        key = self._pnext
        self._pnext += 1
        pid, params = id(p), self._params
        params[pid] = (weakref.ref(p, lambda r, pid=pid: _forget(params, pid, r)), key)
        self._param_unresolved.add(key)
        return key

    @property
    def pending(self) -> bool:
        """Whether something seen since the last resolution still needs a name."""
        return bool(self.unresolved or self._param_unresolved)

    def canonical(self, key: int) -> int:
        return self.alias.get(key, key)

    # -- resolution ----------------------------------------------------------------------------
    def resolve(self, frame=None) -> None:
        """Name every module seen so far from the trees reachable now (called when a step ends
        and new modules were seen, and once more at the end)."""
        self.unresolved.clear()
        live = {}
        for key, m in self.mods.items():
            obj = m.ref() if m.ref is not None else None
            if obj is not None:
                live[key] = obj
        loose: dict[int, tuple] = {}
        roots = _find_roots(frame, loose if self._param_unresolved else None) + [(None, obj) for obj in live.values()]
        index: dict[int, tuple] = {}  # id(module) -> (tree, path), in the largest tree
        pindex: dict[int, tuple] = {}  # id(param) -> (param, tree, name)
        want_params = bool(self._param_unresolved)
        done: set[int] = set()
        for label, root in roots:
            rid = id(root)
            if rid in done or (label is None and rid in index):
                continue  # already named inside a tree found before
            done.add(rid)
            data_parallel = _data_parallel(root)
            try:
                subs = [(_strip(path, data_parallel), sub) for path, sub in root.named_modules()]
            except Exception:  # a module whose named_modules() fails: leave it to the others
                continue
            tree = self._trees.get(rid)
            if tree is None or tree.ref() is not root:
                # torch.compile's and DDP's wrappers: the class they wrap
                inner = root.module if data_parallel else getattr(root, "_orig_mod", None) or \
                    getattr(root, "_fsdp_wrapped_module", None)
                cls = type(inner if isinstance(inner, torch.nn.Module) else root).__name__
                tree = self._trees[rid] = Tree(len(self._trees), cls, label, len(subs),
                                               weakref.ref(root))
            else:
                tree.size = len(subs)
                tree.label = tree.label or label
            for path, sub in subs:
                have = index.get(id(sub))
                if have is None or have[0].size < tree.size:
                    index[id(sub)] = (tree, path)
            if want_params:
                try:
                    for name, p in root.named_parameters():
                        name = _strip(name, data_parallel)
                        have = pindex.get(id(p))
                        if have is None or have[1].size < tree.size:
                            pindex[id(p)] = (p, tree, name)
                except Exception:
                    pass
        self._known = {}
        for key, obj in live.items():
            hit = index.get(id(obj))
            if hit is not None:
                m = self.mods[key]
                m.tree, m.path = hit
                self._known[id(obj)] = (m.ref, *hit)
        for m in list(self.mods.values()):  # modules no tree contains: fold into their caller's group
            if not m.group and m.tree is None and m.key not in self.alias:
                self._fold(m)
        if want_params:
            for pid, (ref, pkey) in list(self._params.items()):
                hit = pindex.get(pid)
                if hit is not None and hit[0] is ref():
                    self._param_at[pkey] = (hit[1], hit[2])
                elif pid in loose and loose[pid][0] is ref() and pkey not in self._param_at:
                    self._param_label[pkey] = loose[pid][1]
            self._param_unresolved.clear()

    def _fold(self, m: Mod) -> None:
        gkey = self._groups.get((m.parent, m.cls))
        if gkey is None:
            gkey = self._next
            self._next += 1
            self._groups[(m.parent, m.cls)] = gkey
            self.mods[gkey] = Mod(gkey, m.cls, m.parent, None, group=True)
        self.alias[m.key] = gkey
        obj = m.ref() if m.ref is not None else None
        if obj is not None:
            self._remember(obj, gkey)

    # -- report time ---------------------------------------------------------------------------
    def names(self) -> dict[int, str]:
        """key -> display name, for every key (groups and folded keys included)."""
        used: dict[int, Tree] = {}
        for m in self.mods.values():
            if m.tree is not None:
                used[m.tree.tid] = m.tree
        for tree, _ in self._param_at.values():
            used.setdefault(tree.tid, tree)
        trees = sorted(used.values(), key=lambda t: (-t.size, t.label is None, t.label or "", t.tid))
        big = [t for t in trees if t.size > 1]
        taken: dict[str, int] = {}
        for t in trees:
            if len(big) <= 1 and big and t is big[0]:
                t.prefix = ""
                continue
            base = t.label or t.cls
            n = taken.get(base, 0)
            taken[base] = n + 1
            t.prefix = base if n == 0 else f"{base}#{n + 1}"
        if len(big) == 0 and len(trees) == 1:
            trees[0].prefix = ""
        out: dict[int, str] = {}
        for key in list(self.mods) + list(self.alias):
            out[key] = self._name(key, out)
        return out

    def _name(self, key: int, memo: dict, depth: int = 0) -> str:
        key = self.canonical(key)
        hit = memo.get(key)
        if hit is not None:
            return hit
        m = self.mods[key]
        if m.tree is not None:
            name = _join(m.tree, m.path)
        elif depth > 32 or m.parent is None or self.canonical(m.parent) not in self.mods:
            name = f"({m.cls})"
        else:
            parent = self._name(m.parent, memo, depth + 1)
            bare_root = parent.startswith("(") and "." not in parent
            name = f"({m.cls})" if bare_root else f"{parent}.({m.cls})"
        memo[key] = name
        return name

    def ancestors(self, names: dict[int, str]) -> dict[str, tuple[str, ...]]:
        """name -> the names of the modules that contain it (its tree's root included)."""
        out: dict[str, tuple[str, ...]] = {}
        for key, m in self.mods.items():
            name = names.get(key)
            if name is None or name in out:
                continue
            chain: list[str] = []
            cur, depth = m, 0
            while cur is not None and depth < 64:
                depth += 1
                if cur.tree is not None:
                    parts = cur.path.split(".") if cur.path else []
                    chain += [_join(cur.tree, ".".join(parts[:i])) for i in range(len(parts) - 1, -1, -1)
                              if i < len(parts)]
                    break
                parent = self.mods.get(self.canonical(cur.parent)) if cur.parent is not None else None
                if parent is not None:
                    chain.append(names.get(parent.key, ""))
                cur = parent
            out[name] = tuple(c for c in chain if c and c != name)
        return out

    def param_name(self, pkey: int) -> str:
        hit = self._param_at.get(pkey)
        if hit is not None:
            return _join(*hit)
        return self._param_label.get(pkey) or f"(parameter #{pkey})"


# components that wrappers add to the paths of the modules they wrap: torch.compile's, FSDP's
# (``use_orig_params=True`` keeps the original parameters under them), activation checkpointing's
_WRAPPER_PARTS = frozenset(("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"))


def _data_parallel(root) -> bool:
    """DistributedDataParallel or DataParallel: the model is their ``module``."""
    return isinstance(root, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) and isinstance(
        getattr(root, "module", None), torch.nn.Module)


def _strip(path: str, data_parallel: bool = False) -> str:
    """A path as the model's author knows it, without the wrappers' components:
    ``encoder._orig_mod.layer.0`` is ``encoder.layer.0``, FSDP's ``_fsdp_wrapped_module.h.0`` is
    ``h.0``, and inside DDP, ``module.h.0`` is ``h.0`` (a wrapper and the module it wraps share
    a name)."""
    if data_parallel and (path == "module" or path.startswith("module.")):
        path = path[7:]
    if not any(w in path for w in _WRAPPER_PARTS):
        return path
    return ".".join(p for p in path.split(".") if p not in _WRAPPER_PARTS)


def _join(tree: Tree, path: str) -> str:
    if path:
        return f"{tree.prefix}.{path}" if tree.prefix else path
    return tree.prefix or f"({tree.cls})"


def _forget(table: dict, key: int, ref) -> None:
    hit = table.get(key)
    if hit is not None and hit[0] is ref:
        del table[key]


# -- finding the trees a script holds ---------------------------------------------------------------
def _user_frames(frame) -> list:
    frames = []
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if not (fn.startswith(_SKIP_DIRS) or fn.startswith("<") or _IGNORED.search(fn)):
            frames.append(f)
        f = f.f_back
    frames.reverse()  # outermost first: the script's own variables come before a library's
    return frames


_LEAF_EXACT = frozenset(t for t in _LEAF_TYPES if t is not type(None)) | {type(None), torch.nn.Parameter}


def _leaf(v) -> bool:
    return type(v) in _LEAF_EXACT or isinstance(v, _LEAF_TYPES)


def _find_roots(frame=None, tensors: dict | None = None) -> list[tuple[str | None, torch.nn.Module]]:
    """(label, module) for every module reachable from the script's globals and the running
    frames' locals, breadth first (so each gets its shortest label), within a budget. With
    ``tensors``, id -> (tensor, label) of the tensors held by those variables is filled in too
    (a tensor optimized directly, without a module: style transfer's input image)."""
    starts: list[tuple[str, object]] = []
    main = sys.modules.get("__main__")
    g = getattr(main, "__dict__", None)
    if isinstance(g, dict):
        starts += [(k, v) for k, v in list(g.items()) if not k.startswith("__")]
    if frame is None:
        frame = sys._getframe(1)
    for f in _user_frames(frame):
        try:
            local = f.f_locals
        except Exception:  # pragma: no cover - a frame that cannot show its locals
            continue
        if local is g:
            continue
        starts += [(k, v) for k, v in list(local.items()) if not k.startswith("__")]
    out: list[tuple[str | None, torch.nn.Module]] = []
    seen: set[int] = set()
    queue = [(label, obj, 0) for label, obj in starts]
    budget = SEARCH_BUDGET
    i = 0
    while i < len(queue) and budget > 0:
        label, obj, depth = queue[i]
        i += 1
        oid = id(obj)
        if oid in seen:
            continue
        seen.add(oid)
        budget -= 1
        if isinstance(obj, weakref.ProxyTypes):
            continue  # `weakref.proxy(trainer)` (Lightning): passes for what it points to, cannot be weakly referenced
        if isinstance(obj, torch.nn.Module):
            out.append((label, obj))
            continue
        if depth >= SEARCH_DEPTH or isinstance(obj, _LEAF_TYPES):
            continue
        try:  # leaves are dropped before their labels are made: most values are numbers and strings
            if isinstance(obj, dict):
                queue += [(f"{label}[{k!r}]", v, depth + 1) for k, v in list(dict.items(obj))[:256]
                          if not _leaf(v)]
            elif isinstance(obj, (list, tuple)):
                queue += [(f"{label}[{j}]", v, depth + 1) for j, v in enumerate(list(obj)[:256]) if not _leaf(v)]
            else:
                d = object.__getattribute__(obj, "__dict__") if hasattr(type(obj), "__dict__") else None
                if not isinstance(d, dict):
                    continue
                queue += [(f"{label}.{k}", v, depth + 1) for k, v in list(dict.items(d))[:256]
                          if isinstance(k, str) and not _leaf(v)]
        except Exception:
            continue
    if tensors is not None:
        for label, obj in starts:
            if isinstance(obj, torch.Tensor) and obj.requires_grad and id(obj) not in tensors:
                tensors[id(obj)] = (obj, label)
    return out


def find_instances(kinds: tuple[type, ...], frame=None) -> bool:
    """Whether an object of one of these types is reachable from the script's variables."""
    main = sys.modules.get("__main__")
    pools = [getattr(main, "__dict__", None) or {}]
    if frame is None:
        frame = sys._getframe(1)
    for f in _user_frames(frame):
        try:
            pools.append(f.f_locals)
        except Exception:  # pragma: no cover
            continue
    seen: set[int] = set()
    queue = [v for pool in pools for v in list(pool.values())]
    budget = SEARCH_BUDGET
    i = 0
    depth_of = {id(v): 0 for v in queue}
    while i < len(queue) and budget > 0:
        obj = queue[i]
        i += 1
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        budget -= 1
        if isinstance(obj, kinds):
            return True
        depth = depth_of.get(id(obj), 0)
        if depth >= SEARCH_DEPTH or isinstance(obj, (_LEAF_TYPES, torch.nn.Module)):
            continue
        try:
            if isinstance(obj, dict):
                nxt = list(dict.values(obj))[:256]
            elif isinstance(obj, (list, tuple)):
                nxt = list(obj)[:256]
            else:
                d = object.__getattribute__(obj, "__dict__") if hasattr(type(obj), "__dict__") else None
                nxt = list(dict.values(d))[:256] if isinstance(d, dict) else []
        except Exception:
            continue
        for v in nxt:
            depth_of.setdefault(id(v), depth + 1)
        queue += nxt
    return False
