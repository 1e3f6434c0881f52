"""The functions the tracer wraps for the length of a trace: GradScaler.step/update/unscale_/scale,
torch.autograd.backward/grad and Optimizer.__init__. Each wrapper calls the original and tells
the tracer; ``remove()`` puts every original back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ampdoctor.trace.tensors import in_functorch_transform

if TYPE_CHECKING:  # pragma: no cover
    from ampdoctor.trace.tracer import Tracer

_current_node = torch._C._current_autograd_node


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def scaler_classes() -> list[type]:
    """torch.amp.GradScaler and every subclass of it loaded now, in a stable order: the classes
    whose own step/update/... a wrapper must replace."""
    base = torch.amp.GradScaler
    return [base] + sorted(set(_subclasses(base)), key=lambda c: f"{c.__module__}.{c.__qualname__}")


class Swaps:
    """Attributes of classes and modules replaced for a while; ``remove()`` puts every original
    back, the last replaced first."""

    def __init__(self) -> None:
        self.originals: list[tuple[object, str, object]] = []

    def set(self, owner, name: str, value) -> None:
        self.originals.append((owner, name, vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)))
        setattr(owner, name, value)

    def remove(self) -> None:
        for owner, name, value in reversed(self.originals):
            setattr(owner, name, value)
        self.originals.clear()


class Patches(Swaps):
    """Wraps GradScaler.step/update/unscale_, torch.autograd.backward/grad and Optimizer.__init__
    for the duration of the trace, and puts every original back in ``remove()``."""

    def __init__(self, tracer: "Tracer") -> None:
        super().__init__()
        self.tracer = tracer
        self.depth = 0

    def install(self) -> None:
        for cls in scaler_classes():
            own = vars(cls)
            if "step" in own:
                self.set(cls, "step", self._wrap_step(own["step"]))
            if "update" in own:
                self.set(cls, "update", self._wrap_update(own["update"]))
            if "unscale_" in own:
                self.set(cls, "unscale_", self._wrap_unscale(own["unscale_"]))
            if "scale" in own:
                self.set(cls, "scale", self._wrap_scale(own["scale"]))
        self.set(torch.autograd, "backward", self._wrap_backward(torch.autograd.backward))
        self.set(torch.autograd, "grad", self._wrap_backward(torch.autograd.grad, returns=True))
        self.set(torch.optim.Optimizer, "__init__", self._wrap_init(vars(torch.optim.Optimizer)["__init__"]))

    def _wrap_step(self, orig):
        tracer = self.tracer

        def step(scaler, optimizer, *args, **kwargs):
            tracer._in_scaler_step += 1
            enabled = getattr(scaler, "_enabled", False)
            tracer._in_enabled_scaler_step += enabled  # a disabled scaler calls optimizer.step() as is
            try:
                return orig(scaler, optimizer, *args, **kwargs)
            finally:
                tracer._in_scaler_step -= 1
                tracer._in_enabled_scaler_step -= enabled
        return step

    def _wrap_unscale(self, orig):
        tracer = self.tracer

        def unscale_(scaler, optimizer):
            if tracer._active:
                tracer._guard(tracer._before_unscale, scaler, optimizer)
            return orig(scaler, optimizer)
        return unscale_

    def _wrap_scale(self, orig):
        tracer = self.tracer

        def scale(scaler, outputs):
            if tracer._active and getattr(scaler, "_enabled", False) and _current_node() is None:
                tracer._guard(tracer._loss, outputs)  # the loss before it is scaled
                out = orig(scaler, outputs)
                tracer._guard(tracer._scaled_by_scaler, out)
                return out
            return orig(scaler, outputs)
        return scale

    def _wrap_update(self, orig):
        tracer, patch = self.tracer, self

        def update(scaler, *args, **kwargs):
            if patch.depth or not tracer._active:  # a subclass calling super().update(): the outer call records
                return orig(scaler, *args, **kwargs)
            patch.depth += 1
            try:
                before = tracer._guard(tracer._scaler_before, scaler)
                result = orig(scaler, *args, **kwargs)
                if before is not None:
                    tracer._guard(tracer._scaler_after, scaler, before)
            finally:
                patch.depth -= 1
            tracer._end_step()
            return result
        return update

    def _wrap_backward(self, orig, returns: bool = False):
        tracer = self.tracer

        def backward(*args, **kwargs):
            top = tracer._active and _current_node() is None and not in_functorch_transform()
            if top and returns:  # autograd.grad's inputs as a sequence: a generator (model.parameters()) is read once
                if len(args) > 1 and _one_pass(args[1]):
                    args = (args[0], tuple(args[1]), *args[2:])
                elif _one_pass(kwargs.get("inputs")):
                    kwargs["inputs"] = tuple(kwargs["inputs"])
            if top:  # the loss: torch.autograd.backward(tensors) or torch.autograd.grad(outputs, ...)
                tracer._guard(tracer._loss, args[0] if args else kwargs.get("tensors", kwargs.get("outputs")))
            result = orig(*args, **kwargs)
            if top and returns and tracer._active:  # the gradients autograd.grad hands back (a penalty)
                tracer._guard(tracer._grad_results, result,
                              bool(kwargs.get("create_graph", args[4] if len(args) > 4 else False)),
                              args[1] if len(args) > 1 else kwargs.get("inputs"),
                              args[0] if args else kwargs.get("outputs"))
            if top and tracer._active and not tracer._is_training():
                tracer._guard(tracer._after_backward)
            return result
        backward.__wrapped__ = orig
        backward.__name__ = getattr(orig, "__name__", "backward")
        backward.__doc__ = getattr(orig, "__doc__", None)
        return backward

    def _wrap_init(self, orig):
        tracer = self.tracer

        def __init__(optimizer, *args, **kwargs):
            tracer._optimizer_made = True
            return orig(optimizer, *args, **kwargs)
        return __init__


def _one_pass(obj) -> bool:
    """An iterable that can be read only once (a generator), not a tensor or a sequence."""
    return obj is not None and not isinstance(obj, (torch.Tensor, list, tuple)) and iter(obj) is obj
