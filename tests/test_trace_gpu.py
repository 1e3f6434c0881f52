"""CUDA checks: real CUDA autocast numerics, and no host sync inside the traced forward/backward.

They are skipped without a CUDA device (CI has none)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ampdoctor.trace import Tracer  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.LayerNorm(256), nn.Linear(256, 1))
    return m.cuda()


def test_cuda_fp16_autocast_overflow_names_the_linear():
    m = _model()
    with torch.no_grad():
        m[2].weight.fill_(500.0)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda") * 4
    with Tracer() as t:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = m(x).float().mean()
        loss.backward()
        opt.step()
    rep = t.report()
    assert rep["first_nonfinite"]["module"] == "2"
    assert any(f["kind"] == "overflow" and f["module"] == "2" for f in rep["findings"])
    # CUDA autocast runs layer_norm in fp32: the tracer reports the dtype that really came out
    ln = next(r for r in rep["modules"] if r["module"] == "3" and r["phase"] == "forward")
    assert ln["dtype"] == "float32"


def test_no_host_sync_inside_traced_forward_and_backward():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(32, 64, device="cuda")
    with Tracer() as t:
        for _ in range(3):
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = m(x).float().mean()
                scaler.scale(loss).backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    assert t.transfers == 3
    assert t.report()["scaler"]["skipped_steps"] == 0
