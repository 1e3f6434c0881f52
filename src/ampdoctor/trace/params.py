"""Parameter gradients, measured all at once right before the optimizer (or the GradScaler) uses them.

For the parameters of one device, a handful of fused ops, whatever their number: one
``_foreach_norm(inf)`` per dtype gives every gradient's exact absmax (NaN and inf included; on the
CPU, where that op is slow, one ``aminmax`` per gradient gives the exact extremes), and
one ``cat`` of an evenly strided view of each gradient (at most ``SAMPLE`` values, no copy of
the gradient), placed one gradient per row, is bucketed and counted like the module rows. The
result is a [parameters, ROW] block that joins the step's single transfer.
"""

from __future__ import annotations

import math

import torch

from ampdoctor.trace import stats as st

SAMPLE = 256


def _flat_sample(g: torch.Tensor) -> torch.Tensor:
    flat = g.view(-1) if g.is_contiguous() else g.reshape(-1)
    n = flat.numel()
    if n > SAMPLE:
        flat = flat[::st.sample_stride(n, SAMPLE)]
    return flat


def measure(grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """One device's gradients -> (flat device tensor of len(grads) * ROW values, values counted
    per gradient). All gradients must be on the same device."""
    device = grads[0].device
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    parts, order = [], []
    for idx in by_dtype.values():
        group = [grads[i] for i in idx]
        if device.type == "cpu":  # the CPU's _foreach_norm(inf) is ten times slower than one aminmax each
            ext = torch.stack([x for g in group for x in torch.aminmax(g)]).view(len(group), 2)
        else:
            norms = torch.stack([n.reshape(()) for n in torch._foreach_norm(group, math.inf)])
            ext = torch.stack([-norms, norms], dim=1)  # absmax as (min, max): NaN and inf are exact
        parts.append(ext.to(torch.float32 if device.type == "mps" else torch.float64))
        order += idx
    if len(parts) == 1:
        ext = parts[0]
    else:  # back to the gradients' order
        where = [0] * len(grads)
        for pos, i in enumerate(order):
            where[i] = pos
        ext = torch.cat(parts).index_select(0, st._to_device(torch.tensor(where, dtype=torch.int64), device))
    flats = [_flat_sample(g) for g in grads]
    lengths = [f.numel() for f in flats]
    flat = torch.cat(flats)
    rows = torch.zeros(len(grads), SAMPLE, dtype=torch.float32, device=device)
    rows.view(-1).index_copy_(0, _places(tuple(lengths), device), flat.to(torch.float32))
    classes = st._classes(rows, [SAMPLE - n for n in lengths])
    out = torch.cat([ext, classes.to(ext.dtype)], dim=1)
    return out.reshape(-1), lengths


_PLACES: dict[tuple, torch.Tensor] = {}


def _places(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Where each sampled value goes in the [gradients, SAMPLE] block: gradient i's values start
    its row i (cached per layout: an optimizer's gradients keep their sizes)."""
    def make():
        idx = torch.cat([torch.arange(i * SAMPLE, i * SAMPLE + n) for i, n in enumerate(lengths)])
        return st._to_device(idx, device)
    return st._memo(_PLACES, (lengths, device), make, limit=16)
