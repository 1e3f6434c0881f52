"""The tracer on code written the way third-party code is: names, culprits, safety and step semantics.

Each test builds the pattern that real training and evaluation code uses (a GAN, a model whose
``__init__`` runs a dummy forward, modules built inside ``forward``, keyword inputs, eval loops,
``torch.func``, checkpointing) and asserts what the user sees in the report."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import textwrap

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from ampdoctor.cli import main  # noqa: E402
from ampdoctor.trace import Tracer  # noqa: E402


def rows(rep, phase=None):
    return {r["module"]: r for r in rep["modules"] if phase is None or r["phase"] == phase}


def bitwise(a, b) -> bool:
    """Equal bit for bit (NaN included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def origins(rep):
    return [(f["module"], f["phase"]) for f in rep["findings"] if f["kind"] in ("nonfinite", "overflow")]


def run_cli(tmp_path, source, *options, args=()):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    r = CliRunner().invoke(main, ["trace", "--format", "json", *options, str(script), *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else None)


# -- never crash the user's run -----------------------------------------------------------------

def test_inference_mode_eval_loop_runs_and_is_measured():
    from ampdoctor.trace import stats

    # as in a fresh process: the tracer's first buffers are made in inference mode
    stats._SPARE.clear()
    stats._Extremes._spare.clear()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)).eval()
    x = torch.randn(4, 8)
    with torch.inference_mode():
        want = m(x)
    with Tracer() as t, torch.inference_mode():
        outs = [m(x) for _ in range(3)]
    for o in outs:
        assert torch.equal(o, want)
    rep = t.report()
    assert rep["notes"] == [] and rep["steps"] == 3
    r = rows(rep, "forward")
    assert r["0"]["calls"] == 3 and r["1"]["calls"] == 3 and r["1"]["absmax"] is not None
    with Tracer() as t:  # a training step traced after it, in the same process
        m.train()(x).pow(2).mean().backward()
    assert t.report()["notes"] == []


def test_torch_func_per_sample_gradients_do_not_break_the_trace():
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of(p, x, y):
        return (functional_call(model, p, (x.unsqueeze(0),)).squeeze() - y) ** 2

    x, y = torch.randn(6, 4), torch.randn(6)
    want = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
    with Tracer() as t:
        per_sample = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, y)
        model(x).pow(2).mean().backward()  # an ordinary step after it is traced as usual
        opt.step()
    for k in want:
        assert torch.equal(per_sample[k], want[k])
    rep = t.report()
    assert rep["notes"] == [] and rep["steps"] == 1
    assert rows(rep, "forward")["0"]["calls"] == 1 and rows(rep, "backward")["0"]["calls"] == 1
    assert any("torch.func" in k for k in rep["skipped_tensors"])


def _overflowing_weight_gradients(how: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with Tracer() as t:
        for step in range(12):
            if step == 8:  # the last layer's weight gradients overflow float16; activation gradients do not
                with torch.no_grad():
                    model[0].weight.mul_(1e3)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(32, 8)).float().pow(2).mean()
            if how == "backward":
                scaler.scale(loss).backward()
            else:  # a functional step: the gradients from torch.autograd.grad, put in .grad by hand
                inputs = model.parameters() if how == "generator" else list(model.parameters())
                for p, g in zip(model.parameters(), torch.autograd.grad(scaler.scale(loss), inputs)):
                    p.grad = g.detach() if how == "detached" else g
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return t.report()


@pytest.mark.parametrize("how", ["list", "generator", "detached"])
def test_a_functional_step_s_parameter_gradients_are_reported_as_backward_s_are(how):
    # gradients that torch.autograd.grad returns for the parameters are the step's parameter
    # gradients, not a gradient penalty's: the report is the one a loss.backward() step gets,
    # whether the parameters are given as a list or as model.parameters(), and whatever tensor
    # the script then puts in .grad
    want, got = _overflowing_weight_gradients("backward"), _overflowing_weight_gradients(how)
    assert got["first_nonfinite"] == want["first_nonfinite"] == {
        "module": None, "phase": "param", "step": 8, "op": None, "params": ["2.weight", "2.bias"]}
    assert got["findings"] == want["findings"]
    assert got["params"] == want["params"] and got["params"][0]["steps"] == 12  # measured once per step


def test_fake_sparse_nested_and_meta_tensors_are_skipped():
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Odd(nn.Module):
        def forward(self, x):
            return {"sparse": x.to_sparse(), "meta": torch.empty(2, device="meta"),
                    "nested": torch.nested.nested_tensor([x[0], x[1, :2]]), "dense": x * 2}

    odd = Odd()
    with Tracer() as t:
        odd(torch.ones(2, 3))
        with FakeTensorMode():
            lin = nn.Linear(3, 3)
            lin(torch.ones(2, 3))
    rep = t.report()
    assert rep["notes"] == []
    assert rows(rep)["odd"]["absmax"] == 2.0  # two lone modules: each named by its variable
    assert {"sparse_coo tensors", "meta tensors", "nested tensors"} <= set(rep["skipped_tensors"])
    assert "FakeTensor tensors" in rep["skipped_tensors"]


def test_an_error_inside_the_tracer_is_a_note_and_the_script_goes_on(monkeypatch):
    from ampdoctor.trace import stats as st

    m = nn.Linear(4, 4)
    x = torch.ones(2, 4)
    want = m(x)

    def broken(self, t):
        raise RuntimeError("simulated tracer bug")

    with Tracer() as t:
        monkeypatch.setattr(st.Batch, "add", broken)
        out = m(x)
        monkeypatch.undo()
        again = m(x)
    assert torch.equal(out, want) and torch.equal(again, want)
    notes = t.report()["notes"]
    assert len(notes) == 1 and "simulated tracer bug" in notes[0] and "went on" in notes[0]


def test_tracer_frames_never_reach_the_scripts_traceback(tmp_path):
    r, rep = run_cli(tmp_path, """\
        import torch
        m = torch.nn.Linear(2, 2)
        with torch.inference_mode():
            y = m(torch.ones(1, 2))
        y.sum().backward()   # the script's own error: inference tensors have no grad
    """, "-o", str(tmp_path / "r.json"))
    assert r.exit_code == 1
    assert "ampdoctor" not in r.stderr.split("the script raised:")[1]
    assert "script.py" in r.stderr


# -- names --------------------------------------------------------------------------------------

class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.lm_head = nn.Linear(4, 3)

    def forward(self, x):
        return self.lm_head(self.decoder(self.encoder(x)))


def _names(rep):
    return sorted({r["module"] for r in rep["modules"]})


def test_names_do_not_depend_on_which_submodule_runs_first():
    model = EncDec()
    x = torch.ones(1, 4)
    with Tracer() as whole:
        model(x)
    with Tracer() as parts:  # what generate() and custom loops do
        h = model.encoder(x)
        h = model.decoder(h)
        model.lm_head(h)
    with Tracer() as backwards:
        model.lm_head(x[:, :4])
        model.decoder(x)
        model.encoder(x)
    expect = ["decoder", "decoder.0", "decoder.1", "encoder", "encoder.0", "encoder.1", "lm_head"]
    assert [n for n in _names(parts.report())] == expect
    assert [n for n in _names(backwards.report())] == expect
    assert _names(whole.report()) == ["(EncDec)"] + expect


def test_a_gan_gets_one_prefix_per_model(tmp_path):
    r, rep = run_cli(tmp_path, """\
        import torch
        from torch import nn

        class Generator(nn.Module):
            def __init__(self):
                super().__init__()
                self.main = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
            def forward(self, z):
                return self.main(z)

        class Discriminator(nn.Module):
            def __init__(self):
                super().__init__()
                self.main = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
            def forward(self, x):
                return self.main(x)

        def train():
            netG, netD = Generator(), Discriminator()
            optG = torch.optim.Adam(netG.parameters(), 1e-3)
            optD = torch.optim.Adam(netD.parameters(), 1e-3)
            bce = nn.BCEWithLogitsLoss()
            for _ in range(2):
                fake = netG(torch.randn(8, 4))
                d_loss = bce(netD(torch.randn(8, 4)), torch.ones(8, 1)) + bce(netD(fake.detach()), torch.zeros(8, 1))
                optD.zero_grad(); d_loss.backward(); optD.step()
                g_loss = bce(netD(fake), torch.ones(8, 1))
                optG.zero_grad(); g_loss.backward(); optG.step()

        if __name__ == "__main__":
            train()
    """)
    assert r.exit_code == 0, r.output
    names = _names(rep)
    assert {"netG.main.0", "netG.main.2", "netD.main.0", "netD.main.2", "netG", "netD", "bce"} <= set(names)
    assert not any(n.startswith(("main", "Discriminator", "Generator")) for n in names)
    assert rows(rep, "backward")["netG.main.0"]["calls"] == 2  # G's backward arrives in D's next step


def test_a_module_dict_root_that_is_never_called_keeps_its_keys():
    nets = nn.ModuleDict({"student": nn.Sequential(nn.Linear(2, 2)), "teacher": nn.Sequential(nn.Linear(2, 2))})
    with Tracer() as t:
        nets["teacher"](torch.ones(1, 2))
        nets["student"](torch.ones(1, 2))
    assert _names(t.report()) == ["student", "student.0", "teacher", "teacher.0"]


def test_a_dummy_forward_in_init_does_not_take_the_names(tmp_path):
    r, rep = run_cli(tmp_path, """\
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2))
                with torch.no_grad():
                    n = self.features(torch.zeros(1, 1, 10, 10)).numel()  # the flatten size
                self.classifier = nn.Linear(n, 2)

            def forward(self, x):
                return self.classifier(self.features(x).flatten(1))

        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(3, 1, 10, 10)).sum().backward()
            opt.step(); opt.zero_grad()
    """)
    assert r.exit_code == 0, r.output
    assert _names(rep) == ["(Net)", "classifier", "features", "features.0", "features.1", "features.2"]


def test_modules_built_inside_forward_collapse_into_one_row():
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk = nn.Linear(8, 8)

        def forward(self, x):
            s = self.qk(x) @ x.transpose(-1, -2)
            return nn.Softmax(dim=-1)(s) @ x  # a new module on every call

    model = nn.Sequential(Attn(), Attn())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Tracer() as t:
        for step in range(5):
            model(torch.randn(2, 3, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                count = len(t.report()["modules"])
        rep = t.report()
    assert len(rep["modules"]) == count  # no new rows after the first steps
    r = rows(rep, "forward")
    assert r["0.(Softmax)"]["calls"] == 5 and r["1.(Softmax)"]["calls"] == 5


def test_inline_loss_module_in_the_top_level_forward_is_one_row():
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, y):
            return nn.CrossEntropyLoss()(self.lin(x), y)  # what many HF heads do

    m = WithLoss()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with Tracer() as t:
        for _ in range(4):
            m(torch.randn(2, 4), torch.tensor([0, 2])).backward()
            opt.step()
    assert _names(t.report()) == ["(CrossEntropyLoss)", "(WithLoss)", "lin"]
    assert rows(t.report(), "forward")["(CrossEntropyLoss)"]["calls"] == 4


# -- inputs: keyword arguments -------------------------------------------------------------------

class CrossAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, hidden, memory=None):
        return self.q(hidden) + memory.mean()


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.wo = nn.Linear(4, 4)
        self.cross = CrossAttn()

    def forward(self, x):
        memory = self.wo(torch.relu(self.enc(x)))
        return self.cross(x, memory=memory)


def test_a_module_fed_non_finite_keyword_inputs_is_not_an_origin():
    m = EncoderDecoder()
    with torch.no_grad():
        m.wo.weight.fill_(1e30)
    with Tracer() as t:
        m(torch.ones(2, 4) * 1e10)
    rep = t.report()
    assert origins(rep) == [("wo", "forward")]
    assert rep["first_nonfinite"]["module"] == "wo"
    assert not rows(rep)["cross"]["origin"]


def test_nan_that_came_with_the_data_is_blamed_on_the_input_not_a_layer():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with Tracer() as t:
        for step in range(3):
            x = torch.randn(8, 4)
            if step == 1:
                x[3, 1] = float("nan")  # one corrupt sample
            m(x).mean().backward()
            opt.step()
            opt.zero_grad()
    rep = t.report()
    assert rep["first_nonfinite"] == {"module": "(Sequential)", "phase": "input", "step": 1, "op": None}
    assert [(f["phase"], f["module"]) for f in rep["findings"] if f.get("origin")] == [("input", "(Sequential)")]
    assert "came in with the data" in rep["findings"][0]["message"]


def test_steps_are_optimizer_steps_even_after_a_dummy_forward_in_init(tmp_path):
    r, rep = run_cli(tmp_path, """\
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2))
                with torch.no_grad():
                    n = self.features(torch.zeros(1, 3, 10, 10)).numel()
                self.fc = nn.Linear(n, 2)

            def forward(self, x):
                return self.fc(torch.flatten(self.features(x), 1))

        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            x = torch.randn(4, 3, 10, 10)
            if step == 3:
                with torch.no_grad():
                    model.features[0].weight[0, 0, 0, 0] = float("inf")  # the layer goes bad at step 3
            loss = model(x).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
    """)
    assert rep["steps"] == 5 and rep["optimizer_steps"] == 5
    assert rep["first_nonfinite"]["step"] == 3 and rep["first_nonfinite"]["module"] == "features.0"


def test_a_json_report_on_stdout_stays_valid_when_the_script_prints(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "noisy.py"
    script.write_text(textwrap.dedent("""\
        import os, torch
        print("epoch 1 loss 0.5")
        os.write(1, b"raw bytes from C code\\n")
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    """))
    out = subprocess.run([sys.executable, "-m", "ampdoctor", "trace", "--format", "json", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["steps"] == 1
    assert "epoch 1 loss 0.5" in out.stderr and "raw bytes from C code" in out.stderr


# -- backward origins ------------------------------------------------------------------------------

class Dist(nn.Module):
    """Distance to the origin: the backward of sqrt at 0 is inf, times 0 is NaN."""

    def forward(self, x):
        return torch.sqrt((x * x).sum(-1, keepdim=True))


class BackwardNaN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.dist = Dist()
        self.head = nn.Linear(1, 1)

    def forward(self, x):
        return self.head(self.dist(self.proj(x)))


def _nan_in_backward_model():
    torch.manual_seed(0)
    m = BackwardNaN()
    with torch.no_grad():
        m.proj.weight.zero_()
        m.proj.bias.zero_()  # proj's output is exactly 0: sqrt's backward divides by 0
    return m


def test_a_nan_born_in_a_modules_backward_is_blamed_on_that_module():
    m = _nan_in_backward_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with Tracer() as t:
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    rep = t.report()
    assert rep["first_nonfinite"]["module"] == "dist" and rep["first_nonfinite"]["phase"] == "backward"
    assert origins(rep) == [("dist", "backward")]
    f = rep["findings"][0]
    assert "--ops" in f["message"]


def test_ops_names_the_autograd_node_and_its_forward_line():
    m = _nan_in_backward_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with Tracer(ops=True) as t:
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    rep = t.report()
    first = rep["first_nonfinite"]
    assert first["module"] == "dist" and first["op"] == "SqrtBackward0"
    assert "test_trace_real.py" in first["line"] and "torch.sqrt" in first["line"]
    assert "SqrtBackward0" in rep["findings"][0]["message"]


def test_without_ops_the_node_is_named_when_the_same_backward_fails_again():
    def run(tracer):
        m = _nan_in_backward_model()
        grads = []
        with tracer:
            for _ in range(3):
                m(torch.ones(2, 4)).sum().backward()
                grads.append(m.proj.weight.grad.clone())
                m.zero_grad()
        return grads

    plain = run(contextlib.nullcontext())
    t = Tracer()
    traced = run(t)
    assert all(bitwise(a, b) for a, b in zip(plain, traced))
    first = t.report()["first_nonfinite"]
    assert (first["module"], first["step"], first["op"]) == ("dist", 0, "SqrtBackward0")
    assert "torch.sqrt" in first["line"]
    assert "failed again, at step 1" in t.report()["findings"][0]["message"]


def test_a_nan_in_the_loss_backward_outside_any_module():
    lin = nn.Linear(4, 1)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.zero_()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with Tracer() as t:
        torch.sqrt(lin(torch.ones(2, 4))).sum().backward()  # finite loss, NaN gradient at lin's output
        opt.step()
    rep = t.report()
    assert rep["first_nonfinite"] == {"module": None, "phase": "backward", "step": 0, "op": None, "line": None}
    assert "outside any module" in rep["findings"][0]["message"]


# -- parameter gradients and the loss --------------------------------------------------------------

def test_a_scaler_skip_from_parameter_gradients_only_names_them():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    x = torch.ones(64, 4)
    with torch.no_grad():
        m[1].weight.fill_(1.0)
    with Tracer() as t:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                out = m(x * 100.0)
            # every output gradient is 2000, finite in fp16; the bias gradient sums 64 of them
            scaler.scale(out.float().sum() * 2000.0).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    rep = t.report()
    sc = rep["scaler"]
    assert sc["steps"][0]["skipped"] and "1.bias" in sc["steps"][0]["nonfinite_params"]
    assert all(r["nonfinite"] == {"nan": 0, "pinf": 0, "ninf": 0} for r in rep["modules"])
    params = {p["param"]: p for p in rep["params"]}
    assert params["1.bias"]["nonfinite_steps"] >= 1 and params["1.bias"]["scaled"]


def test_the_loss_is_measured_before_the_gradscaler_scales_it():
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with Tracer() as t:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = m(torch.ones(2, 4)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert t.report()["loss"]["absmax"] == pytest.approx(loss.item())


def test_a_non_finite_loss_computed_outside_any_module_is_its_own_origin():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with Tracer() as t:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = m(torch.randn(3, 4))
            p = torch.softmax(logits.float(), -1)
            loss = -(torch.log(p * 0.0)).mean()  # log(0): inf
            loss.backward()
            opt.step()
            opt.zero_grad()
    rep = t.report()
    assert rep["first_nonfinite"]["phase"] == "loss" and rep["first_nonfinite"]["module"] is None
    f = rep["findings"][0]
    assert f["phase"] == "loss" and "outside any module" in f["message"]
    assert "not a mixed-precision overflow" in f["message"]
    assert [x for x in rep["findings"] if x["phase"] == "backward"] == []
    assert rep["loss"]["nonfinite_steps"] == [0, 1]


def test_gradients_that_flush_to_zero_in_pure_fp16_are_an_underflow():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).half()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with Tracer() as t:
        for _ in range(2):
            (m(torch.randn(8, 16).half()).float().mean() * 1e-9).backward()  # every fp16 gradient is 0
            opt.step()
            opt.zero_grad()
    rep = t.report()
    assert all(r["absmax"] == 0 for r in rep["modules"] if r["phase"] == "backward")
    under = [f for f in rep["findings"] if f["kind"] == "underflow"]
    assert under and "flushed to zero" in under[0]["message"] and "GradScaler" in under[0]["message"]


def test_reentrant_checkpointing_still_gets_gradient_statistics():
    from torch.utils.checkpoint import checkpoint

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=True))

    torch.manual_seed(0)
    m = Model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(2, 4, requires_grad=True)
    with Tracer() as t:
        for _ in range(2):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    b = rows(t.report(), "backward")
    assert b["block.0"]["calls"] == 2 and b["block.2"]["calls"] == 2 and b["head"]["calls"] == 2
    assert rows(t.report(), "forward")["block.0"]["calls"] == 2  # the recomputation is not counted


def test_an_output_the_loss_does_not_use_gets_no_gradient_and_breaks_nothing():
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x).chunk(2, dim=-1)  # two outputs of one autograd node

    net = Split()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with Tracer() as t:
        for _ in range(2):
            a, b = net(torch.randn(4, 8))
            a.sum().backward()  # b is unused: autograd calls its hook with None
            opt.step()
    rep = t.report()
    assert rep["notes"] == [] and rep["steps"] == 2
    assert rows(rep, "backward")["lin"]["calls"] == 2


def test_ops_names_autocasts_weight_cast_as_the_overflowing_op():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.rand(16, 16) * 1e5 + 7e4)  # every weight beyond float16's 65504
    with Tracer(ops=True) as t:
        with torch.autocast("cpu", dtype=torch.float16):  # its cast cache is on
            lin(torch.rand(4, 16))
    op = t.report()["op_origin"]
    assert op["op"] == "aten._to_copy" and op["produced"] == "inf" and "cast to float16" in op["note"]


# -- --ops changes nothing -------------------------------------------------------------------------------

class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return torch.log(self.drop(self.bn(self.lin(x))).abs() * 0)  # -inf: replayed by --ops


def _bn_run(ops):
    torch.manual_seed(0)
    m = nn.Sequential(BNBlock(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    with Tracer(ops=ops) as t:
        outs = [m(x) for _ in range(2)]
    return t, outs, m.state_dict()


def test_ops_replay_leaves_batchnorm_buffers_rng_and_outputs_alone():
    t0, outs0, state0 = _bn_run(False)
    t1, outs1, state1 = _bn_run(True)
    assert t1.report()["op_origin"]["op"] == "aten.log"
    for a, b in zip(outs0, outs1):
        assert bitwise(a, b)
    assert state1["0.bn.num_batches_tracked"].item() == 2
    for k in state0:
        assert bitwise(state0[k], state1[k]), k


def test_ops_replay_does_not_append_to_a_kwargs_cache_twice():
    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, cache=None):
            cache["keys"].append(self.lin(x))
            return torch.log(torch.cat(cache["keys"]).abs() * 0)  # -inf

    def run(ops):
        torch.manual_seed(0)
        m = Cached()
        cache = {"keys": []}
        with Tracer(ops=ops) as t:
            out = m(torch.ones(1, 4), cache=cache)
        return t, out, cache

    t0, out0, cache0 = run(False)
    t1, out1, cache1 = run(True)
    assert t1.report()["op_origin"]["op"] == "aten.log"
    assert len(cache1["keys"]) == len(cache0["keys"]) == 1
    assert bitwise(out0, out1)


# -- steps without an optimizer ----------------------------------------------------------------------------

def test_an_eval_loop_of_10000_forwards_is_flat_in_memory_and_counts_steps():
    m = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 16)
    with Tracer() as t, torch.no_grad():
        for i in range(10_000):
            m(x)
            if i == 1000:
                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                size = len(t._pending)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
        assert len(t._pending) <= size
    rep = t.report()
    assert rep["steps"] == 10_000 and rows(rep)["0"]["calls"] == 10_000
    assert grown < 20 * 1024  # KiB


def test_manual_sgd_without_an_optimizer_counts_a_step_per_iteration():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with Tracer() as t:
        for _ in range(5):
            m(torch.randn(3, 4)).pow(2).mean().backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    rep = t.report()
    assert rep["steps"] == 5
    assert rows(rep, "backward")["0"]["calls"] == 5


def test_a_validation_loop_between_training_steps_keeps_the_step_numbers():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with Tracer() as t:
        for step in range(4):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                with torch.no_grad():
                    for _ in range(20):
                        m(torch.randn(2, 4))
    rep = t.report()
    assert rep["steps"] == 4 and rep["optimizer_steps"] == 4
    assert rows(rep, "forward")["0"]["calls"] == 24


# -- the command line ------------------------------------------------------------------------------------

FP16_OVERFLOW = """\
    import torch
    from torch import nn
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        m[0].weight.fill_(1e4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.float16):
        out = m(torch.ones(2, 4) * 100)
    out.float().sum().backward()
    opt.step()
"""


def test_fail_on_nonfinite_fires_on_any_nan_or_inf(tmp_path):
    r, rep = run_cli(tmp_path, FP16_OVERFLOW, "--fail-on", "nonfinite")
    assert [f["kind"] for f in rep["findings"]][:1] == ["overflow"]
    assert rep["first_nonfinite"]["module"] == "0"
    assert r.exit_code == 1


def test_fail_on_scaler_ignores_the_warm_up_back_off(tmp_path):
    r, rep = run_cli(tmp_path, """\
        import torch
        from torch import nn
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # far too high: it backs off first
        for _ in range(12):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    """, "--fail-on", "scaler,nonfinite")
    sc = rep["scaler"]
    assert sc["warmup_skips"] >= 1 and sc["unexpected_skips"] == 0
    assert rep["first_nonfinite"] is None and rep["findings"] == []
    assert r.exit_code == 0


def test_a_script_that_fails_before_any_step_says_so(tmp_path):
    script = tmp_path / "early.py"
    script.write_text("import torch\nraise RuntimeError('no data found')\n")
    r = CliRunner().invoke(main, ["trace", str(script)])
    assert r.exit_code == 1
    first = r.stdout.splitlines()[0]
    assert "No numerical problems" not in r.stdout
    assert "before any module ran" in first and "RuntimeError: no data found" in first


def test_output_path_is_checked_before_the_script_runs(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    r = CliRunner().invoke(main, ["trace", "-o", str(tmp_path / "missing" / "r.json"), str(script)])
    assert r.exit_code == 2 and "cannot write" in r.stderr
    assert not marker.exists()


def test_unknown_options_before_the_script_are_usage_errors_and_the_rest_goes_to_it(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys, json\nprint(json.dumps(sys.argv[1:]), file=sys.stderr)\n")
    r = CliRunner().invoke(main, ["trace", "--bogus", str(script)])
    assert r.exit_code == 2 and "No such option '--bogus'" in r.stderr
    r = CliRunner().invoke(main, ["trace", "--format", "json", str(script), "--ops", "-o", "x", "--bogus"])
    assert r.exit_code == 0, r.output
    assert '["--ops", "-o", "x", "--bogus"]' in r.stderr
    assert json.loads(r.stdout)["op_origin"] is None
    assert not os.path.exists("x")


# -- hand-written training code -----------------------------------------------------------------------

def test_autograd_grad_with_keywords_runs_as_it_does_untraced():
    # a WGAN-GP gradient penalty: torch.autograd.grad(outputs=..., inputs=..., create_graph=True)
    def run(tracer):
        torch.manual_seed(0)
        D = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        opt = torch.optim.Adam(D.parameters(), 1e-3)
        losses = []
        with tracer:
            for _ in range(2):
                x = torch.randn(6, 4, requires_grad=True)
                g, = torch.autograd.grad(outputs=D(x).sum(), inputs=x, create_graph=True)
                loss = ((g.norm(2, dim=1) - 1) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
        return losses

    want = run(contextlib.nullcontext())
    t = Tracer()
    got = run(t)
    assert all(bitwise(a, b) for a, b in zip(want, got))
    assert t.report()["notes"] == [] and t.report()["steps"] == 2


def test_an_additive_inf_attention_mask_is_not_non_finite_data():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True, dropout=0.0)
    opt = torch.optim.SGD(layer.parameters(), lr=0.01)
    mask = nn.Transformer.generate_square_subsequent_mask(5)  # 0 above, -inf below: the documented API
    with Tracer() as t:
        for _ in range(2):
            layer(torch.randn(2, 5, 16), src_mask=mask, is_causal=True).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rep = t.report()
    assert rep["first_nonfinite"] is None
    assert [f for f in rep["findings"] if f["kind"] in ("nonfinite", "overflow")] == []


def test_a_module_given_a_mask_is_still_blamed_for_its_own_overflow():
    class Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x, mask):
            s = x @ x.transpose(-1, -2) * 1e36  # overflows float32 on its own
            return torch.softmax(s + mask, -1) @ self.proj(x)

    mask = torch.triu(torch.full((3, 3), float("-inf")), 1)
    with Tracer() as t:
        Scores()(torch.ones(1, 3, 4) * 100, mask)
    assert t.report()["first_nonfinite"]["module"] == "(Scores)"
    assert t.report()["first_nonfinite"]["phase"] == "forward"


def _nan_backward_scaler_run(steps, dtype=None):
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("active", torch.tensor([1.0, 1.0, 1.0, 0.0]))

        def forward(self, x):
            return torch.sqrt(x.exp() * self.active)  # a pruned unit: sqrt(0), whose backward is NaN

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Scale(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with Tracer() as t:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype or torch.float16, enabled=dtype is not None):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return t.report()


def test_a_backward_nan_on_every_step_is_not_a_gradscaler_warm_up():
    # float32 gradients cannot overflow at any loss scale: every skip is unexpected
    rep = _nan_backward_scaler_run(3)
    assert [s["health"] for s in rep["scaler"]["steps"]] == ["unexpected"] * 3
    assert rep["first_nonfinite"]["module"] == "1" and rep["first_nonfinite"]["step"] == 0
    assert rep["first_nonfinite"]["op"] == "SqrtBackward0"  # named when it failed again
    # float16: a back-off that never lets a step through, down to a scale below 1024, is a fault too
    rep = _nan_backward_scaler_run(8, torch.float16)
    assert set(s["health"] for s in rep["scaler"]["steps"]) == {"unexpected"}
    assert rep["first_nonfinite"]["module"] == "1" and rep["first_nonfinite"]["phase"] == "backward"
    assert any(f["kind"] == "scaler" for f in rep["findings"])


def test_manual_updates_count_one_step_per_iteration_and_measure_parameter_gradients():
    torch.manual_seed(0)
    rnn = nn.GRU(8, 8, batch_first=True).half()
    head = nn.Linear(8, 4).half()
    criterion = nn.CrossEntropyLoss()  # a second top-level module in the same iteration
    with Tracer() as t:
        for _ in range(6):
            out, _ = rnn(torch.randn(2, 5, 8).half())
            loss = criterion(head(out[:, -1]).float(), torch.tensor([1, 3])) * 1e-3
            loss.backward()
            with torch.no_grad():
                for p in list(rnn.parameters()) + list(head.parameters()):
                    p.add_(p.grad, alpha=-0.1)
                    p.grad = None
    rep = t.report()
    assert rep["steps"] == 6 and rep["loss"]["steps"] == 6
    names = {p["param"] for p in rep["params"]}
    assert "rnn.weight_hh_l0" in names and "head.bias" in names
    assert all(p["steps"] == 6 for p in rep["params"])


def test_max_steps_counts_optimizer_steps_after_forward_passes_in_init(tmp_path):
    r, rep = run_cli(tmp_path, """\
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.conv1 = nn.Conv2d(3, 4, 3)
                self.bn1 = nn.BatchNorm2d(4)
                self.pool = nn.MaxPool2d(2)
                with torch.no_grad():  # the flatten size, from the parts called one by one
                    n = self.pool(self.bn1(self.conv1(torch.zeros(1, 3, 10, 10)))).numel()
                self.fc = nn.Linear(n, 2)

            def forward(self, x):
                return self.fc(self.pool(self.bn1(self.conv1(x))).flatten(1))

        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            model(torch.randn(4, 3, 10, 10)).pow(2).mean().backward()
            opt.step(); opt.zero_grad()
    """, "--max-steps", "2")
    assert r.exit_code == 0 and rep["script"]["stopped_by_max_steps"]
    assert rep["optimizer_steps"] == 2 and rep["steps"] == 2


def test_an_evaluation_script_stops_after_max_steps_iterations(tmp_path):
    r, rep = run_cli(tmp_path, """\
        import torch
        backbone, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        with torch.no_grad():
            for _ in range(100):
                head(backbone(torch.randn(2, 4)))  # two top-level modules per iteration
    """, "--max-steps", "5")
    assert rep["steps"] == 5 and rep["script"]["stopped_by_max_steps"]
    assert rows(rep)["backbone"]["calls"] == 5 and rows(rep)["head"]["calls"] == 5


def test_a_compiled_model_is_named_as_itself_and_not_over_claimed():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(x) * 1e38 * 10  # overflows float32 inside compiled code

    net = Net()
    compiled = torch.compile(net, backend="eager")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with Tracer() as t:
        compiled(torch.ones(1, 4)).sum().backward()
        opt.step()
    rep = t.report()
    assert {r["module"] for r in rep["modules"]} <= {"(Net)", "inner"}
    assert {p["param"] for p in rep["params"]} == {"inner.weight", "inner.bias"}
    f = rep["findings"][0]
    assert f["module"] == "(Net)" and "torch.compile" in f["message"] and "submodule output" not in f["message"]


def test_a_disabled_gradscaler_still_gets_parameter_gradients_measured():
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # nanoGPT's pattern for bf16
    with Tracer() as t:
        for _ in range(2):
            scaler.scale(m(torch.randn(3, 4)).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    rep = t.report()
    assert rep["steps"] == 2 and {p["param"] for p in rep["params"]} == {"weight", "bias"}
    assert all(p["steps"] == 2 for p in rep["params"])


def test_a_tensor_optimized_without_a_module_is_named_by_its_variable():
    target = torch.randn(1, 8)
    input_img = torch.zeros(1, 8, requires_grad=True)
    opt = torch.optim.LBFGS([input_img], max_iter=3)
    net = nn.Linear(8, 8)

    def closure():
        opt.zero_grad()
        loss = (net(input_img) - target).pow(2).mean()
        loss.backward()
        return loss

    with Tracer() as t:
        for _ in range(2):  # LBFGS computes the gradient inside step(): the second step sees it
            opt.step(closure)
    assert [p["param"] for p in t.report()["params"]] == ["input_img"]


def test_finding_lines_keep_the_module_name_in_the_text_report():
    from ampdoctor.report import trace_text
    from rich.console import Console
    import io

    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        m[0].weight.fill_(1e38)
    with Tracer() as t:
        m(torch.ones(1, 4) * 10)
    buf = io.StringIO()
    trace_text.render(Console(file=buf, width=120, color_system=None), t.report())
    lines = buf.getvalue().splitlines()
    assert "nonfinite · 0 · forward, step 0" in lines
    table = lines[lines.index(next(x for x in lines if x.startswith("worst layers"))) + 2:]
    assert table[0].split()[:3] == [">", "0", "Linear"]  # the origin row comes first, marked


# -- blame: order and stored values ----------------------------------------------------------------

class _TwoTables(nn.Module):
    """Two independent modules that both make NaN in one call: `zz` runs first, `aa` second."""

    def __init__(self):
        super().__init__()
        self.zz = nn.Embedding(10, 4)
        self.aa = nn.Embedding(10, 4)

    def forward(self, x):
        return self.zz(x).sum() + self.aa(x).sum()


def test_the_first_origin_is_the_module_that_failed_first_not_the_first_by_name():
    m = _TwoTables()
    with torch.no_grad():
        m.zz.weight[3, 0] = float("nan")
        m.aa.weight[3, 0] = float("nan")
    with Tracer() as t, torch.no_grad():
        for _ in range(2):
            m(torch.tensor([3, 4]))
    rep = t.report()
    assert rep["first_nonfinite"]["module"] == "zz"
    assert [o for o, _ in origins(rep)] == ["zz", "aa"]


def test_nan_stored_in_the_weights_is_not_blamed_on_the_forward_code():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        m[2].weight[0, 0] = float("nan")
    with Tracer() as t, torch.no_grad():
        for _ in range(2):
            m(torch.ones(3, 4))
    rep = t.report()
    f = next(f for f in rep["findings"] if f["module"] == "2")
    assert "`weight` already held NaN/Inf" in f["message"] and "own forward code" not in f["message"]


def test_nan_made_by_a_forward_and_then_written_by_the_update_is_still_the_forwards():
    """Without a scaler, the inf a forward makes reaches the weights through the optimizer in the
    same step: at the end of that step the weights hold NaN, but the forward made it first."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        m[0].weight.fill_(1.0)
        m[1].weight.fill_(1.0)  # the first layer's weight gradient, 2 x 3e38, overflows too
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with Tracer() as t:
        loss = m(torch.full((2, 4), 3e38)).sum()  # 4 x 3e38 overflows float32 in the first Linear
        loss.backward()
        opt.step()
    assert not torch.isfinite(m[0].weight).all()  # the update wrote the non-finite values in
    rep = t.report()
    f = next(f for f in rep["findings"] if f["phase"] == "forward")
    assert f["module"] == "0" and "already held" not in f["message"]


def test_a_gradient_penalty_that_overflows_is_named_as_such_not_as_the_loss_code():
    """The AMP gradient-penalty recipe: autograd.grad(scaler.scale(out), x, create_graph=True).
    At the initial scale the float16 gradient overflows; the loss built on it is non-finite, but
    the loss code is not at fault, and the skip is the GradScaler's warm-up."""
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(D.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    with Tracer() as t:
        for _ in range(2):
            x = torch.randn(3, 4).requires_grad_()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = D(x)
            g = torch.autograd.grad(scaler.scale(out), x, grad_outputs=torch.ones_like(out), create_graph=True)[0]
            g = g / scaler.get_scale()
            loss = out.float().mean() + ((g.norm(2, dim=1) - 1) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    rep = t.report()
    assert rep["scaler"]["steps"][0]["skipped"] and rep["scaler"]["steps"][0]["health"] == "warmup"
    assert not any(f["phase"] == "loss" for f in rep["findings"])
    origin = next(o for o in t.origins if o.step == 0)
    assert origin.phase == "backward" and origin.via == "autograd.grad"


def test_ops_replay_never_blames_uninitialised_memory():
    """`empty_like` returns whatever bits the allocator hands out, NaN patterns included (with
    deterministic algorithms on, torch fills them with NaN on purpose); the replay must name the
    op that computed the non-finite value, not an allocation."""
    class Alloc(nn.Module):
        def forward(self, x):
            scratch = torch.empty_like(x)
            scratch.fill_(1.0)
            return torch.log(x * 0) + scratch

    m = Alloc()
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.isnan(torch.empty(4)).all()  # uninitialised memory is NaN here
        with Tracer(ops=True) as t:
            m(torch.ones(8, 8))
    finally:
        torch.use_deterministic_algorithms(prev)
    assert t.report()["op_origin"]["op"] == "aten.log"


def test_a_run_whose_every_step_was_skipped_is_not_called_healthy():
    """Four steps, all skipped while the scale backs off: the skips may all be warm-up, but the
    text verdict must not say "No numerical problems found" (GPT-2 from a config showed it)."""
    from ampdoctor.report import trace_text

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.mul_(30)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with Tracer() as t:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    report = t.report()
    assert report["scaler"]["skipped_steps"] == len(report["scaler"]["steps"]) == 4
    text = trace_text.verdict(report)
    assert text.startswith("Not judged: the GradScaler skipped all 4 optimizer step(s)"), text
