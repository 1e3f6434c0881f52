"""Watch mode (`--watch`, `Watcher`): nothing is copied to the host while the run is healthy, the
bad step is found and replayed under a full trace, and the run's results do not change."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from ampdoctor.cli import main  # noqa: E402
from ampdoctor.trace.watch import Watcher  # noqa: E402
from conftest import FIXTURES, trace_fixture  # noqa: E402

SCRIPT = FIXTURES / "trace" / "watch_bad_batch.py"


def _watch_json(*opts, script_args=()):
    r = CliRunner().invoke(main, ["trace", "--watch", "--format", "json", *opts, str(SCRIPT), *script_args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return json.loads(r.stdout)


def test_the_bad_step_is_replayed_and_its_origin_named():
    rep = _watch_json("--watch-steps", "2")
    assert rep["watch"]["trigger"] == {"step": 30, "reason": "the loss is not finite"}
    assert rep["watch"]["traced_steps"] == [30, 32] and rep["watch"]["replayed"] is True
    assert rep["first_nonfinite"]["module"] == "mlp.up"
    assert rep["first_nonfinite"]["phase"] == "forward" and rep["first_nonfinite"]["step"] == 30
    assert any(f["kind"] == "overflow" and f["module"] == "mlp.up" and f["step"] == 30 for f in rep["findings"])
    assert rep["steps"] == 40 and rep["transfers"] == 3  # only the traced steps were copied to the host


def test_a_healthy_run_is_not_traced_and_says_what_was_checked():
    r = CliRunner().invoke(main, ["trace", "--watch", "--width", "100", str(SCRIPT), "--bad-step", "-1"])
    assert r.exit_code == 0
    assert "No trouble in 40 watched step(s): every loss was finite and the GradScaler never kept skipping" \
        in " ".join(r.output.split())
    rep = _watch_json(script_args=("--bad-step", "-1"))
    assert rep["watch"]["trigger"] is None and rep["transfers"] == 0 and rep["findings"] == []


def _counting(monkeypatch):
    calls = {"item": 0, "tolist": 0, "cpu": 0, "__bool__": 0}
    for name in calls:
        orig = getattr(torch.Tensor, name)

        def f(self, *a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, f)
    return calls


def test_no_host_transfer_in_healthy_steps(monkeypatch):
    mod = trace_fixture("watch_bad_batch")
    mod.train(steps=2)  # warm up outside the count
    calls = _counting(monkeypatch)
    mod.train(steps=30)
    untraced = dict(calls)
    for k in calls:
        calls[k] = 0
    with Watcher() as w:
        mod.train(steps=30)
    monkeypatch.undo()
    # the GradScaler's own syncs (its inf check in step()) are all there is, with or without the watch
    assert calls == untraced
    assert w.trigger is None and w.transfers == 0 and w.steps == 30


def test_watching_and_replaying_change_nothing_bitwise():
    mod = trace_fixture("watch_bad_batch")
    model, losses = mod.train(steps=34)
    with Watcher(trace_steps=2) as w:
        wmodel, wlosses = mod.train(steps=34)
    assert w.trigger["step"] == 30 and not w.replayed  # the replay ran (dropout, BatchNorm statistics)
    # the bad batch leaves NaN in BatchNorm's running statistics, in both runs alike
    assert all(_same(a, b) for a, b in zip(model.state_dict().values(), wmodel.state_dict().values()))
    assert all(_same(a, b) for a, b in zip(losses, wlosses))


def _same(a, b) -> bool:
    """Bitwise equal, NaN included."""
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def _plain_run(steps, watcher=None, nan_data_at=None, nan_loss_at=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.2),
                                torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watcher if watcher is not None else torch.enable_grad():
        for step in range(steps):
            x = torch.randn(16, 4)
            if step == nan_data_at:
                x[0, 0] = float("nan")  # a NaN in the data
            loss = model(x).pow(2).mean()
            if step == nan_loss_at:
                loss = loss * float("inf") * 0  # a NaN made after the model, by the loss code
            loss.backward()
            if step != nan_loss_at:
                opt.step()
            opt.zero_grad()
    return model


def test_a_non_finite_loss_without_a_scaler_is_replayed_before_the_update():
    from ampdoctor.trace import Tracer

    w = Tracer(mode="watch", trace_steps=1)
    assert isinstance(w, Watcher)
    _plain_run(12, w, nan_data_at=7)
    rep = w.report()
    assert rep["watch"]["trigger"] == {"step": 7, "reason": "the loss is not finite"}
    assert rep["first_nonfinite"]["phase"] == "input" and rep["first_nonfinite"]["step"] == 7


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "vector"])
def test_a_non_finite_loss_is_seen_whatever_its_dtype_and_shape(kind):
    # a one-value float32 loss is read where it is; a bf16 one (numpy has no bfloat16) and a
    # loss of several values are checked with ops: the three start the trace at the same step
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w = Watcher(trace_steps=1)
    with w:
        for step in range(8):
            out = model(torch.randn(8, 4))
            loss = out.pow(2).mean(0) if kind == "vector" else out.pow(2).mean()
            if kind == "bfloat16":
                loss = loss.to(torch.bfloat16)
            if step == 5:
                loss = loss * float("inf")
            loss.backward(torch.ones_like(loss) if kind == "vector" else None)
            opt.step()
            opt.zero_grad()
    assert w.trigger == {"step": 5, "reason": "the loss is not finite"}
    assert w.report()["first_nonfinite"]["step"] == 5


def test_the_replay_puts_back_the_rng_and_the_buffers():
    # the forward is healthy and replayed in train mode (BatchNorm counts a batch, Dropout draws);
    # the run goes on exactly as without the watch
    ref = _plain_run(12, nan_loss_at=5)
    w = Watcher(trace_steps=1)
    got = _plain_run(12, w, nan_loss_at=5)
    assert w.trigger == {"step": 5, "reason": "the loss is not finite"} and not w.replayed
    assert all(_same(a, b) for a, b in zip(ref.state_dict().values(), got.state_dict().values()))


def test_a_collapsing_scale_starts_the_trace_and_its_skips_are_no_warm_up():
    rep = _watch_json("--watch-steps", "2", script_args=("--bad-step", "-1", "--blowup-step", "20", "--steps", "30"))
    assert rep["watch"]["trigger"] == {"step": 22, "reason": "the GradScaler skipped 3 steps in a row: the loss "
                                                             "scale is collapsing"}
    assert rep["first_nonfinite"]["phase"] == "backward" and rep["first_nonfinite"]["step"] == 22
    # the scaler had settled 20 steps before: the traced skips are faults, not its warm-up
    assert any(f["kind"] == "scaler" for f in rep["findings"])


class _Scales(torch.nn.Module):
    """Scales its input in place, as some models normalise their batch (x.div_(255))."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x.div_(255.0))


class _ActsInPlace(torch.nn.Module):
    """Leaves its input alone; its first child is an in-place ReLU on its own copy."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU(inplace=True)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


def _in_place_run(model_cls, watcher=None, nan_loss_at=5, scale=255.0):
    torch.manual_seed(0)
    model = model_cls()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = []
    with watcher if watcher is not None else torch.enable_grad():
        for step in range(8):
            x = torch.randn(16, 4) * scale
            loss = model(x).pow(2).mean()
            if step == nan_loss_at:
                loss = loss * float("inf") * 0
            loss.backward()
            batches.append(x)
            if step != nan_loss_at:
                opt.step()
            opt.zero_grad()
    return model, batches


def test_a_model_that_changes_its_inputs_in_place_is_not_replayed_on_changed_values():
    """The replay would run the model on its inputs as they are after the call: a model that
    divided its batch in place would see it divided twice, and a replay on the script's own
    tensors would change them. Changed inputs are not replayed (the report says so); others are
    replayed on copies."""
    ref_model, ref_batches = _in_place_run(_Scales)
    w = Watcher(trace_steps=1)
    model, batches = _in_place_run(_Scales, w)
    assert w.trigger == {"step": 5, "reason": "the loss is not finite"}
    assert any("changed in place after its call" in n for n in w.replayed)
    assert all(torch.equal(a, b) for a, b in zip(ref_batches, batches))
    assert all(torch.equal(a, b) for a, b in zip(ref_model.state_dict().values(), model.state_dict().values()))

    ref_model, ref_batches = _in_place_run(_ActsInPlace, scale=1.0)
    w = Watcher(trace_steps=1)
    model, batches = _in_place_run(_ActsInPlace, w, scale=1.0)
    assert w.trigger["step"] == 5 and not w.replayed  # replayed
    assert all(torch.equal(a, b) for a, b in zip(ref_batches, batches))
    assert all(torch.equal(a, b) for a, b in zip(ref_model.state_dict().values(), model.state_dict().values()))


class _LossAndLogits(torch.nn.Module):
    """Returns its loss and the logits it computed the loss from, as a causal LM given labels does."""

    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    def forward(self, x, y):
        logits = self.head(torch.relu(self.body(x)))
        return torch.nn.functional.cross_entropy(logits, y), logits


class _Critic(torch.nn.Module):
    """Called on the logits, or on an object that holds them (as a cache or a graph batch does)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(torch.tanh(x if isinstance(x, torch.Tensor) else x.logits) * 2)


def _loss_and_logits_run(tracer_at_5, use: str):
    from types import SimpleNamespace

    torch.manual_seed(0)
    model, critic = _LossAndLogits(), _Critic()
    opt = torch.optim.SGD([*model.parameters(), *critic.parameters()], lr=0.1)
    nan = torch.tensor(float("nan"))
    for step in range(8):
        with tracer_at_5 if step == 5 else torch.enable_grad():
            loss, logits = model(torch.randn(16, 4), torch.randint(0, 3, (16,)))
            if use == "logits":
                loss = loss + logits.pow(2).mean()
            elif use == "critic":  # a second model called on the first one's output
                loss = loss + critic(logits).mean()
            elif use == "critic-of-object":  # ... handed to it inside an object
                loss = loss + critic(SimpleNamespace(logits=logits)).mean()
            elif use == "two-passes":  # the loss, then a second backward pass through the logits
                loss.backward(retain_graph=True)
                loss = logits.pow(2).mean()
            if step == 5:  # the loss code goes non-finite; the gradients stay finite
                loss = loss + nan
            loss.backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("walk", [None, 0], ids=["walked", "every-gradient-kept"])
@pytest.mark.parametrize("use", ["loss", "logits", "critic", "critic-of-object", "two-passes"])
def test_the_replayed_backward_is_the_real_one_when_the_model_returns_its_loss_and_logits(use, walk, monkeypatch):
    # the logits' gradient already holds what came back through the loss: fed back beside the
    # loss's, it would count twice and the replay would show gradients the run never had. The
    # watch keeps the gradients of the outputs used after the call; when it cannot tell which
    # (too much code between the calls and the loss) it keeps all and the replay is the same.
    # Each backward pass of the step is replayed as a pass of its own
    from ampdoctor.trace import Tracer

    if walk is not None:
        monkeypatch.setattr(Watcher, "MAX_WALK", walk)
    full = Tracer(first_step=5)
    _loss_and_logits_run(full, use)
    w = Watcher(trace_steps=0)
    with w:
        _loss_and_logits_run(torch.enable_grad(), use)
    assert w.trigger == {"step": 5, "reason": "the loss is not finite"} and not w.replayed

    def backward(rep):  # every figure of every layer's backward, traced at step 5 only
        return {m["module"]: m for m in rep["modules"] if m["phase"] == "backward"}
    want, got = backward(full.report()), backward(w.report())
    body = next(k for k in want if k.endswith("body"))  # `model.body` where the script has two models
    assert got == want and {"head", "critic"} & {k.rsplit(".", 1)[-1] for k in want} == \
        ({"head", "critic"} if use.startswith("critic") else {"head"})
    assert want[body]["elements"] == (256 if use == "two-passes" else 128)  # one measurement per pass


def test_outputs_computed_from_each_other_get_back_only_what_came_from_outside():
    # a call returns c = g(b), b = f(a) and a (a twice); the code after it uses all three. Fed
    # the hooks' gradients as they are, b and a would get c's and b's gradient a second time
    from ampdoctor.trace.replay import external_grads

    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)

    def call(x):
        a = lin(x)
        b = torch.tanh(a) * 3
        return b.pow(2).sum(1), a, b, a

    x = torch.randn(5, 6)
    weights = [torch.randn(5), torch.randn(5, 6), torch.randn(5, 6), torch.randn(5, 6)]
    outs = call(x)
    seen = [None] * 4
    for i, o in enumerate(outs):
        o.register_hook(lambda g, i=i: seen.__setitem__(i, g))
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()

    replayed = call(x)
    pairs = external_grads(list(zip(replayed, seen)))
    assert len(pairs) == 3  # a returned twice counts once
    got = torch.autograd.grad([o for o, _ in pairs], [lin.weight, lin.bias], [g for _, g in pairs])
    assert torch.allclose(got[0], lin.weight.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[1], lin.bias.grad, rtol=1e-5, atol=1e-6)


def test_a_step_whose_backward_is_torch_autograd_grad_is_replayed_too():
    # a functional step (gradients from torch.autograd.grad, handed to the optimizer by hand) under
    # a GradScaler whose scale collapses: the watch finds the model and replays its backward
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    w = Watcher(trace_steps=1)
    with w:
        for step in range(14):
            if step == 8:
                with torch.no_grad():
                    model[0].weight.mul_(1e3)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(32, 8)).float().pow(2).mean()
            params = list(model.parameters())
            for p, g in zip(params, torch.autograd.grad(scaler.scale(loss), params)):
                p.grad = g
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert w.trigger == {"step": 10, "reason": "the GradScaler skipped 3 steps in a row: the loss scale is collapsing"}
    assert w.replayed == []  # forward and backward
    replayed = {m["module"] for m in w.report()["modules"]
                if m["phase"] == "backward" and 10 in dict(m["absmax_by_step"])}
    assert replayed >= {"0", "1", "2"}


@pytest.mark.parametrize("use", ["loss", "logits", "critic-of-object"])
def test_the_watch_keeps_no_gradient_that_only_the_model_itself_used(use):
    # a causal LM called with labels: the logits' gradient came back through the model's own
    # loss, and a replay gets it back the same way, so the watch keeps nothing of it. Used after
    # the call, it is kept, as a copy in a host buffer that serves every step: autograd's own
    # buffer is never held past the backward (holding it costs the CPU allocator more)
    import weakref
    from types import SimpleNamespace

    torch.manual_seed(0)
    model, critic = _LossAndLogits(), _Critic()
    opt = torch.optim.SGD([*model.parameters(), *critic.parameters()], lr=0.1)
    held = []
    w = Watcher()
    with w:
        for _ in range(3):
            loss, logits = model(torch.randn(16, 4), torch.randint(0, 3, (16,)))
            nr = logits.output_nr
            logits.grad_fn.register_prehook(lambda grads, nr=nr: held.append(weakref.ref(grads[nr])))
            if use == "logits":
                loss = loss + logits.pow(2).mean()
            elif use == "critic-of-object":
                loss = loss + critic(SimpleNamespace(logits=logits)).mean()
            loss.backward()
            assert held[-1]() is None
            opt.step()
            opt.zero_grad()
        kept = [tuple(b.shape) for b in w._buffers]
    assert ((16, 3) in kept) == (use != "loss") and () in kept  # () the loss's


class _Logits(torch.nn.Module):
    """Returns its loss too when it is given labels: how many outputs a call has varies."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        if labels is None:
            return {"logits": logits}
        return {"logits": logits, "loss": torch.nn.functional.cross_entropy(logits, labels)}


def test_more_top_level_calls_in_a_step_than_the_watch_keeps_change_nothing():
    # 18 calls per step (more than the 16 kept), the last without labels: the calls past the 16th
    # are not kept, and their outputs' gradients reach no kept call's hooks
    def run(watcher):
        torch.manual_seed(0)
        model = _Logits()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with watcher if watcher is not None else torch.enable_grad():
            for _ in range(3):
                total = 0
                for k in range(18):
                    out = model(torch.randn(8, 4), torch.randint(0, 3, (8,)) if k < 17 else None)
                    total = total + (out["loss"] if "loss" in out else out["logits"].pow(2).mean())
                total.backward()
                opt.step()
                opt.zero_grad()
        return model

    w = Watcher()
    want, got = run(None), run(w)
    assert w.notes == {} and w.steps == 3
    assert all(_same(a, b) for a, b in zip(want.state_dict().values(), got.state_dict().values()))


class _G(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)

    def forward(self, z):
        return torch.tanh(self.lin(z))


def _gan_run(real: dict, bad_step=5):
    # a GAN step: the critic's optimizer steps before the generator's backward, which comes back
    # through the generator's call made before that step ended (for the watch, each optimizer
    # step is a step)
    torch.manual_seed(0)
    gen, critic = _G(), torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LeakyReLU(), torch.nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(critic.parameters(), lr=0.01)
    softplus = torch.nn.functional.softplus
    for step in range(8):
        fake = gen(torch.randn(8, 3))
        loss_d = softplus(-critic(torch.randn(8, 4))).mean() + softplus(critic(fake.detach())).mean()
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad()
        loss_g = softplus(-critic(fake)).mean()
        if step == bad_step:
            loss_g = loss_g + torch.tensor(float("nan"))
        loss_g.backward()
        if step == bad_step:
            real.update({name: p.grad.clone() for name, p in gen.named_parameters()})
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
    return gen


def test_a_gan_s_generator_is_replayed_in_the_generator_s_step(monkeypatch):
    # the replay's parameter gradients (what its torch.autograd.grad returns) are the real ones
    from ampdoctor.trace import replay as rp

    replayed: dict = {}
    unwrapped = rp.unwrapped

    def spy(fn):
        grad = unwrapped(fn)

        def recorded(outputs, inputs, **kwargs):
            got = grad(outputs, inputs, **kwargs)
            for p, g in zip(inputs, got):
                if isinstance(p, torch.nn.Parameter) and g is not None:
                    replayed[id(p)] = replayed.get(id(p), 0) + g
            return got
        return recorded
    monkeypatch.setattr(rp, "unwrapped", spy)
    real: dict = {}
    w = Watcher(trace_steps=0)
    with w:
        gen = _gan_run(real)
    assert w.trigger == {"step": 11, "reason": "the loss is not finite"} and not w.replayed
    for name, p in gen.named_parameters():
        assert torch.allclose(replayed[id(p)], real[name], rtol=1e-5, atol=1e-7), name
