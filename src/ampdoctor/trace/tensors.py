"""Which tensors the tracer can measure, and how to find them in a module's inputs and outputs.

A tensor is measured only when reading it cannot fail or change anything: a dense, strided,
floating-point tensor with values in memory (not meta), and not a tensor subclass that
intercepts operations (``FakeTensor``, ``DTensor``, ``FunctionalTensor``, a functorch wrapper
from ``vmap``/``grad``). Everything else is skipped and counted by kind, so the report can say
what it did not see.
"""

from __future__ import annotations

import dataclasses

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_BUFFER = getattr(torch.nn, "Buffer", None)
if isinstance(_BUFFER, type):  # pragma: no branch - torch >= 2.5 has nn.Buffer
    _PLAIN = (*_PLAIN, _BUFFER)

try:
    _is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    _interpreter = torch._C._functorch.peek_interpreter_stack
except AttributeError:  # pragma: no cover - torch without functorch
    def _is_wrapped(t) -> bool:
        return False

    def _interpreter():
        return None


def in_functorch_transform() -> bool:
    """True inside ``torch.func.vmap``/``grad``/``jvp``/``vjp``: tensors there are wrappers that
    are only valid inside the transform."""
    return _interpreter() is not None


def skip_reason(t: torch.Tensor) -> str | None:
    """None when ``t`` can be measured, else the kind of tensor it is (for the report's notes).
    Integer, bool, complex and empty tensors are not numerics of interest and give ""."""
    cls = type(t)
    if cls is torch.Tensor or cls in _PLAIN:  # the hot path: one check per attribute
        if t.dtype not in _FLOATING or not t.numel():
            return ""
        if t.layout is _STRIDED and not t.is_nested and not t.is_meta:
            return None
        return _odd(t)
    if cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return f"{cls.__name__} tensors"
    if _is_wrapped(t):
        return "torch.func (vmap/grad) tensors"
    if not t.dtype.is_floating_point or not t.numel():
        return ""
    return _odd(t)


_STRIDED = torch.strided
_FLOATING = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point)


def _odd(t: torch.Tensor) -> str | None:
    if t.layout is not torch.strided:
        return f"{str(t.layout).replace('torch.', '')} tensors"
    if t.is_nested:
        return "nested tensors"
    if t.is_meta:
        return "meta tensors"
    if _is_wrapped(t):
        return "torch.func (vmap/grad) tensors"
    return None


def on_gradient(t: torch.Tensor, fn) -> None:
    """Call ``fn`` with the gradient that flows into ``t`` (None for an output the loss did not
    use), through a pre-hook of the node that made ``t``: what ``t.register_hook`` does, for less.
    A node kind without pre-hooks gets ``t.register_hook``. ``fn`` returns None."""
    node, nr = t.grad_fn, t.output_nr
    try:
        node.register_prehook(lambda grads: fn(grads[nr] if nr < len(grads) else None))
    except (AttributeError, RuntimeError):
        t.register_hook(fn)


def tensors_in(obj, depth: int = 0) -> list:
    """Every tensor in a module's inputs or outputs: tuples, lists, dicts (``ModelOutput`` too),
    dataclasses and namedtuples, to a bounded depth; anything else is skipped."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return []
    if isinstance(obj, (list, tuple)):
        for v in obj:
            if not isinstance(v, torch.Tensor):
                return [t for v in obj for t in tensors_in(v, depth + 1)]
        return list(obj)  # the common case, without recursion
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v, depth + 1)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name, None), depth + 1)]
    return []
