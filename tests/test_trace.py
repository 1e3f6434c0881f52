"""The tracer on real CPU numerics: fixtures/trace scenarios, API, safety and overhead rules."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from ampdoctor.cli import main  # noqa: E402
from ampdoctor.trace import Tracer  # noqa: E402
from conftest import FIXTURES  # noqa: E402

TRACE = FIXTURES / "trace"


def trace_json(script, *args):
    r = CliRunner().invoke(main, ["trace", "--format", "json", *args, str(TRACE / script)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r, json.loads(r.stdout)


def kinds(report):
    return sorted({f["kind"] for f in report["findings"]})


# -- the scenarios ---------------------------------------------------------------------------

def test_fp16_linear_overflow_blames_that_linear():
    r, rep = trace_json("fp16_linear_overflow.py")
    assert r.exit_code == 0
    assert rep["first_nonfinite"] == {"module": "blowup", "phase": "forward", "step": 0, "op": None}
    over = [f for f in rep["findings"] if f["kind"] == "overflow"]
    assert [f["module"] for f in over] == ["blowup"]
    assert "float16" in over[0]["message"]
    r, _ = trace_json("fp16_linear_overflow.py", "--fail-on", "overflow")
    assert r.exit_code == 1


def test_float32_inputs_beyond_fp16_range_blame_the_cast_not_the_arithmetic():
    """Raw features up to 300,000 fed to a Linear under fp16 autocast: the layer's arithmetic is
    fine, the cast of its float32 input to float16 made the inf, and the finding says so."""
    r, rep = trace_json("unnormalised_inputs.py")
    assert r.exit_code == 0
    assert rep["first_nonfinite"]["module"] == "0" and rep["first_nonfinite"]["step"] == 2
    (f,) = [f for f in rep["findings"] if f["module"] == "0"]
    assert f["kind"] == "overflow" and 65504 < f["input_absmax"] <= 300_000
    assert "from float32 inputs that hold values up to" in f["message"]
    assert "Scale or normalise the inputs" in f["message"]
    # a layer that overflows from inputs inside the range keeps its own message
    _, rep = trace_json("fp16_linear_overflow.py")
    (f,) = [f for f in rep["findings"] if f["kind"] == "overflow"]
    assert "input_absmax" not in f and "from finite inputs" in f["message"]


def test_log_of_zero_is_named_by_the_op_replay():
    _, rep = trace_json("log_zero.py", "--ops")
    assert rep["first_nonfinite"]["module"] == "features"
    assert rep["first_nonfinite"]["op"] == "aten.log"
    assert rep["op_origin"]["produced"] == "inf"


def test_pure_fp16_without_scaler_underflows_in_backward():
    _, rep = trace_json("fp16_underflow.py")
    under = [f for f in rep["findings"] if f["kind"] == "underflow"]
    assert len(under) == 1 and under[0]["phase"] == "backward"
    assert "GradScaler" in under[0]["message"]
    assert rep["target_dtype"] == "float16"


def test_healthy_bf16_run_has_no_findings_and_passes_fail_on():
    r, rep = trace_json("bf16_healthy.py", "--fail-on", "all")
    assert r.exit_code == 0
    assert rep["findings"] == [] and rep["first_nonfinite"] is None
    assert rep["target_dtype"] == "bfloat16" and rep["steps"] == 3


def test_fp32_activations_beyond_fp16_range_depend_on_the_target():
    _, rep = trace_json("fp32_large_activations.py", "--target", "float16")
    over = [f for f in rep["findings"] if f["kind"] == "overflow"]
    assert [f["module"] for f in over] == ["amplify"]
    assert "would overflow" in over[0]["message"]
    _, rep = trace_json("fp32_large_activations.py", "--target", "bfloat16")
    assert rep["findings"] == []


def test_attention_overflow_origin_is_the_matmul_not_the_projection():
    _, rep = trace_json("attention_overflow.py", "--ops")
    assert rep["first_nonfinite"]["module"] == "0.attn"
    assert rep["first_nonfinite"]["op"] in ("aten.bmm", "aten.matmul", "aten.mm")
    assert all(f["module"] != "0.attn.c_proj" for f in rep["findings"])


def test_scaler_skips_are_reported_per_step():
    _, rep = trace_json("scaler_skips.py")
    sc = rep["scaler"]
    assert sc["initial_scale"] == 2.0 ** 24
    assert sc["final_scale"] < sc["initial_scale"]
    # the initial back-off from 2**24 is the scaler at work, not a finding
    assert [s["health"] for s in sc["steps"][:6]] == ["warmup"] * 5 + ["ok"]
    assert sc["warmup_skips"] == 5
    # step 7 skips again at a scale that had worked: only the bias gradient of the last layer
    # (a sum over the batch in float16) overflowed, every activation gradient was finite
    assert sc["steps"][7]["health"] == "unexpected" and sc["steps"][7]["nonfinite_params"] == ["2.bias"]
    assert [f["kind"] for f in rep["findings"]] == ["nonfinite", "scaler"]
    assert "`2.bias`" in rep["findings"][1]["message"]
    assert rep["first_nonfinite"] == {"module": None, "phase": "param", "step": 7, "op": None, "params": ["2.bias"]}


def test_json_contract_fields():
    _, rep = trace_json("fp16_linear_overflow.py")
    for key in ("version", "target_dtype", "steps", "findings", "first_nonfinite", "modules", "scaler"):
        assert key in rep
    for f in rep["findings"]:
        assert {"kind", "module", "phase", "step", "message"} <= set(f)
    for m in rep["modules"]:
        assert {"module", "class", "phase", "dtype", "absmax", "min_nonzero", "nonfinite", "overflow_fraction",
                "underflow_fraction", "calls"} <= set(m)


def test_text_and_html_reports(tmp_path):
    r = CliRunner().invoke(main, ["trace", str(TRACE / "fp16_linear_overflow.py")])
    assert r.stdout.splitlines()[0].startswith("NaN/Inf first appeared in `blowup`")
    out = tmp_path / "r.html"
    r = CliRunner().invoke(main, ["trace", "--format", "html", "-o", str(out), str(TRACE / "bf16_healthy.py")])
    page = out.read_text()
    assert r.exit_code == 0 and page.startswith("<!doctype html>") and "<svg" in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # self-contained


def test_html_escapes_module_names():
    from ampdoctor.report import trace_html

    evil = "<script>alert(1)</script>"
    rep = {"version": "x", "target_dtype": "float16", "dtypes_seen": [], "steps": 1, "transfers": 1,
           "findings": [{"kind": "nonfinite", "module": evil, "phase": "forward", "step": 0, "message": evil}],
           "first_nonfinite": {"module": evil, "phase": "forward", "step": 0, "op": None}, "op_origin": None,
           "modules": [{"module": evil, "class": evil, "phase": "forward", "dtype": "float16", "calls": 1,
                        "absmax": 1.0, "min_nonzero": 0.5, "nonfinite": {"nan": 1, "pinf": 0, "ninf": 0},
                        "overflow_fraction": 0.0, "underflow_fraction": 0.0, "headroom_bits": 15.0}],
           "scaler": None}
    page = trace_html.render(rep)
    assert evil not in page
    assert "&lt;script&gt;" in page


# -- the script runner ------------------------------------------------------------------------

def test_script_argv_main_and_sibling_imports(tmp_path):
    (tmp_path / "helper_mod.py").write_text("SCALE = 3.0\n")
    (tmp_path / "train.py").write_text(textwrap.dedent("""\
        import argparse
        import torch
        from helper_mod import SCALE
        if __name__ == "__main__":
            p = argparse.ArgumentParser()
            p.add_argument("--steps", type=int)
            a = p.parse_args()
            m = torch.nn.Linear(2, 2)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(a.steps):
                m(torch.ones(1, 2) * SCALE).sum().backward(); opt.step(); opt.zero_grad()
    """))
    r = CliRunner().invoke(main, ["trace", "--format", "json", str(tmp_path / "train.py"), "--steps", "4"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["steps"] == 4
    r = CliRunner().invoke(main, ["trace", "--format", "json", "--max-steps", "2", str(tmp_path / "train.py"),
                                  "--steps", "50"])
    rep = json.loads(r.stdout)
    assert r.exit_code == 0 and rep["steps"] == 2 and rep["script"]["stopped_by_max_steps"]


def test_script_error_still_reports_and_exits_non_zero(tmp_path):
    (tmp_path / "boom.py").write_text(textwrap.dedent("""\
        import torch
        m = torch.nn.Linear(2, 2)
        m(torch.ones(1, 2))
        raise ValueError("bad batch")
    """))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["trace", "--format", "json", "-o", str(out), str(tmp_path / "boom.py")])
    assert r.exit_code == 1
    assert "ValueError: bad batch" in r.stderr
    rep = json.loads(out.read_text())
    assert rep["script"]["error"] and rep["modules"]
    (tmp_path / "exit3.py").write_text("import sys\nsys.exit(3)\n")
    assert CliRunner().invoke(main, ["trace", str(tmp_path / "exit3.py")]).exit_code == 3


def test_bad_trace_arguments(tmp_path):
    r = CliRunner().invoke(main, ["trace", str(tmp_path / "missing.py")])
    assert r.exit_code == 2 and "no such file" in r.stderr
    r = CliRunner().invoke(main, ["trace", "--fail-on", "explosions", str(TRACE / "bf16_healthy.py")])
    assert r.exit_code == 2 and "unknown finding kind 'explosions'" in r.stderr


def test_trace_without_torch_is_one_line_exit_2():
    script = textwrap.dedent(f"""\
        import sys
        class _NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("no torch here")
        sys.meta_path.insert(0, _NoTorch())
        from ampdoctor.cli import main
        sys.argv = ["ampdoctor", "trace", {str(TRACE / 'bf16_healthy.py')!r}]
        main()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "ampdoctor: error: `ampdoctor trace` needs torch: pip install 'ampdoctor[trace]'"


# -- safety and overhead -------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.fc(x)) + x


@dataclass
class Out:
    logits: torch.Tensor
    extra: dict


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, x, ids=None):
        h = self.shared(self.shared(x))  # weight sharing: one module called twice
        h = torch.utils.checkpoint.checkpoint(self.shared, h, use_reentrant=False)
        return Out(self.head(h), {"ids": ids, "n": 3, "none": None, "empty": torch.empty(0)})


def _train(steps=3, tracer=None, amp=True):
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4, 8)
    ids = torch.arange(4)
    outs = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(x, ids=ids)
        loss = out.logits.float().pow(2).mean()
        loss.backward()
        outs.append(out.logits.detach().clone())
        outs.append(model.shared.fc.weight.grad.detach().clone())
        opt.step()
        opt.zero_grad()
    return outs, [p.detach().clone() for p in model.parameters()]


def test_tracing_changes_nothing_bitwise():
    base_outs, base_params = _train()
    with Tracer() as t:
        outs, params = _train()
    for a, b in zip(base_outs + base_params, outs + params):
        assert torch.equal(a, b)
    rep = t.report()
    assert rep["steps"] == 3 and rep["findings"] == []
    names = {m["module"] for m in rep["modules"]}
    assert {"shared", "shared.fc", "shared.act", "head", "(Model)"} <= names
    shared = next(m for m in rep["modules"] if m["module"] == "shared" and m["phase"] == "forward")
    assert shared["calls"] == 9  # twice plus the checkpointed call, three steps; recomputation not counted


@pytest.mark.parametrize("value", [
    0.0, -0.0, 1.0, -3.0, 2.0 ** -25 * 0.9, 2.0 ** -25 * 1.1, 2.0 ** -24, 2.0 ** -14 * 0.99, 2.0 ** -14,
    6e-5, 65504.0, 65519.0, 65520.0, -65520.0, 1e5, 2.0 ** -126, 7e-39, 3.3e38, 3.4e38, float("inf"),
    float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_value_lands_in_the_class_its_format_gives_it(value, dtype):
    from ampdoctor.trace import stats as st
    from ampdoctor.trace.formats import FORMATS

    if dtype == torch.float32 and abs(value) > 3.4028234663852886e38 and value == value and abs(value) != float("inf"):
        pytest.skip("not a float32")
    t = torch.tensor([value], dtype=dtype)
    batch = st.Batch(t.device)
    n, sampled = batch.add(t)
    row = batch.rows().tolist()
    s = st.summarise(str(dtype), row, n, sampled)
    for name, fmt in FORMATS.items():
        got = {c for c, k in s.classes[name].items() if k}
        assert got == {st.classify(float(t[0]), fmt)}, (name, value, s.classes[name])


def _rows(tensors, hold=None, reuse=True):
    from ampdoctor.trace import stats as st

    batch = st.Batch(torch.device("cpu"))
    batch.reuse = reuse  # False: a fresh block per step, as on accelerators
    if hold is not None:
        batch.HOLD = hold
    sizes = [batch.add(t) for t in tensors]
    values = batch.rows().tolist()
    return [st.summarise(str(t.dtype), values[i * st.ROW:(i + 1) * st.ROW], *sizes[i]) for i, t in enumerate(tensors)]


def test_a_batch_keeps_each_tensor_apart_whatever_the_dtypes_and_grouping():
    tensors = [torch.full((3,), -2.0, dtype=torch.bfloat16), torch.tensor([0.0, 0.0, 70000.0]),
               torch.tensor([1e-6, 5.0], dtype=torch.bfloat16), torch.tensor([-1e300, 1.0], dtype=torch.float64),
               torch.zeros(10), torch.tensor([float("nan"), 1.0], dtype=torch.float16),
               torch.linspace(-3, 3, 50_000)]
    for hold, reuse in ((None, True), (1, True), (None, False), (1, False)):  # counted at once or one by one
        s = _rows(tensors, hold, reuse)
        assert [(x.vmin, x.vmax) for x in s[:5]] == [(-2.0, -2.0), (0.0, 70000.0), (pytest.approx(1e-6, rel=1e-2), 5.0),
                                                    (-1e300, 1.0), (0.0, 0.0)]
        assert s[0].classes["float16"]["normal"] == 3 and s[0].classes["float16"]["zero"] == 0
        assert s[1].classes["float16"] == {**dict.fromkeys(s[1].classes["float16"], 0.0), "zero": 2.0, "overflow": 1.0}
        assert s[1].classes["bfloat16"]["normal"] == 1 and s[1].classes["bfloat16"]["overflow"] == 0
        assert s[2].classes["float16"]["subnormal"] == 1 and s[2].classes["bfloat16"]["subnormal"] == 0
        assert s[4].classes["float16"]["zero"] == 10 and s[4].min_nonzero == float("inf")  # padding is not counted
        assert s[5].classes["float16"]["nan"] == 1 and not s[5].finite
        assert s[2].min_nonzero <= 1e-6 < 2 * s[2].min_nonzero
        big = s[6]  # a sample of 256 values stands for all 50,000
        assert big.sampled and sum(big.classes["float16"].values()) == pytest.approx(50_000, rel=1e-3)
        assert (big.vmin, big.vmax) == (-3.0, 3.0)


def test_the_sample_sees_every_channel_of_a_power_of_two_layout():
    # [tokens, 128]: one channel of ones, the others below float16's smallest subnormal. A stride
    # that divides 128 would see the ones' channel only.
    for n_tokens in (512, 64, 3):
        x = torch.full((n_tokens, 128), 1e-9)
        x[:, 0] = 1.0
        for grads in (False, True):
            if grads:
                from ampdoctor.trace import params as pm
                from ampdoctor.trace import stats as st

                flat, lengths = pm.measure([x])
                s = st.summarise("float32", flat.tolist(), x.numel(), lengths[0])
            else:
                s = _rows([x])[0]
            flush = s.classes["float16"]["flush"] / x.numel()
            assert flush == pytest.approx(127 / 128, abs=0.03), (n_tokens, grads, flush)


def test_batches_of_other_widths_do_not_share_sample_indices(monkeypatch):
    import warnings

    from ampdoctor.trace import stats as st

    x = torch.linspace(1.0, 2.0, 10_000)
    for width in (256, 512, 256):
        monkeypatch.setattr(st, "SAMPLE_CPU", width)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an index of the wrong length would resize the block's row
            s = _rows([x, torch.zeros(7)])
        assert s[0].classes["float16"]["normal"] == pytest.approx(10_000)
        assert s[1].classes["float16"]["zero"] == 7 and s[0].sampled


@pytest.mark.parametrize("n", [257, 300, 768, 1001, 16384, 16384 * 67, 3 * 5 * 7 * 11 * 13 * 17, 100_003])
def test_a_spread_sample_takes_distinct_values_from_the_whole_tensor(n):
    from ampdoctor.trace import stats as st

    index = st.spread_index(n, 256, torch.device("cpu")).tolist()
    assert len(index) == 256 == len(set(index)) and 0 <= min(index) and max(index) < n
    assert min(index) == 0 and max(index) > n * 0.9  # the first pass reaches the end


def test_a_block_used_again_holds_none_of_the_last_steps_values():
    from ampdoctor.trace import stats as st

    first = _rows([torch.randn(5000) * 1e-6, torch.full((40,), 3.0)])
    assert first[0].min_nonzero < 1e-6
    again = _rows([torch.zeros(3), torch.tensor([2.0])])  # short rows, written where the values were
    assert again[0].classes["float16"] == {**dict.fromkeys(st.CLASSES, 0.0), "zero": 3.0}
    assert again[0].min_nonzero == float("inf")
    assert again[1].classes["bfloat16"] == {**dict.fromkeys(st.CLASSES, 0.0), "normal": 1.0}


def test_parameter_gradients_counted_apart_agree_with_a_batch():
    # accelerators count parameter gradients in their own narrower block (params.measure); the
    # CPU counts them with the module tensors. Both must give the same summaries.
    from ampdoctor.trace import params as pm
    from ampdoctor.trace import stats as st

    grads = [torch.randn(30, 7) * 1e-5, torch.tensor([0.0, 1e-8, float("inf")]),
             torch.randn(64, dtype=torch.float64), torch.randn(700).to(torch.bfloat16)[::3],
             torch.full((4,), float("nan"), dtype=torch.float16),
             torch.linspace(-1e-6, 1e-6, 9000).view(90, 100) * 3.0]
    flat, lengths = pm.measure(grads)
    values = flat.tolist()
    apart = [st.summarise(str(g.dtype), values[i * st.ROW:(i + 1) * st.ROW], g.numel(), lengths[i])
             for i, g in enumerate(grads)]
    together = _rows(grads)
    for a, b, g in zip(apart, together, grads):
        assert (a.vmin, a.vmax, a.sampled) == (b.vmin, b.vmax, b.sampled) or (a.vmin != a.vmin and b.vmin != b.vmin)
        if g.numel() <= pm.SAMPLE:  # all values in both: the same counts
            assert a.counts == b.counts and a.min_nonzero == b.min_nonzero
        else:  # samples of the same size from different places: the same fractions, near enough
            for name in ("float16", "bfloat16"):
                for cls, k in a.classes[name].items():
                    assert k / g.numel() == pytest.approx(b.classes[name][cls] / g.numel(), abs=0.05), (name, cls)
    assert apart[1].classes["float16"]["zero"] == 1 and apart[1].classes["float16"]["flush"] == 1
    assert apart[1].classes["float16"]["pinf"] == 1 and apart[4].classes["bfloat16"]["nan"] == 4


def _rounded(obj):
    if isinstance(obj, float):
        return float(f"{obj:.9g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


@pytest.mark.parametrize("script", ["fp16_underflow.py", "fp16_linear_overflow.py", "scaler_skips.py"])
def test_counts_summed_a_step_at_a_time_match_adding_each_tensor(script, monkeypatch):
    # The fast path (clean tensors folded from a tuple, counts summed per aggregate a step at a
    # time) against a summary for every tensor, its counts added one tensor at a time.
    from ampdoctor.trace import records, stats as st, tracer

    _, fast = trace_json(script)
    real = records.add_counts

    def one_by_one(agg, s, sums):
        real(agg, s, None)

    def always_a_summary(self, dtype, at, numel, sampled_n, rid=-1):
        return self.summary((at, dtype, numel, sampled_n, 0, 0, 0, rid))

    monkeypatch.setattr(records, "add_counts", one_by_one)
    monkeypatch.setattr(tracer, "add_counts", one_by_one)
    monkeypatch.setattr(st.Measured, "row", always_a_summary)
    _, slow = trace_json(script)
    assert fast["modules"] and fast["params"]
    assert _rounded(fast["modules"]) == _rounded(slow["modules"])
    assert _rounded(fast["params"]) == _rounded(slow["params"])


def _train_with_a_report_mid_step(steps, mid):
    # an embedding of which 4 rows of 16 are used: 3/4 of its gradient is exactly zero; a ReLU
    # makes zeros in the activations
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.tensor([[1, 3, 5, 7]])
    early = None
    with Tracer() as t:
        for i in range(steps):
            model(ids).pow(2).mean().backward()
            if i == mid:
                early = t.report()  # rows of this step are counted but have no owners yet
            opt.step()
            opt.zero_grad()
    return early, t.report()


def test_deferred_counts_survive_small_blocks_and_a_report_in_the_middle_of_a_step(monkeypatch):
    # The CPU's sample rows are counted a block at a time, blocks spanning steps. Blocks of 3 rows
    # (every step crosses several, parameter gradients among them) and a report asked for
    # between backward and the optimizer step must give the counts of one big block.
    from ampdoctor.trace import stats as st

    _, want = _train_with_a_report_mid_step(4, -1)
    emb = next(p for p in want["params"] if p["param"] == "0.weight")
    assert emb["zero_fraction"] == 0.75 and emb["steps"] == 4  # exact: 12 of 16 rows unused
    monkeypatch.setitem(st._BLOCK, "defer", 3 * st.SAMPLE_CPU)
    early, got = _train_with_a_report_mid_step(4, 2)
    assert "error" not in got.get("notes", {}) and "error" not in early.get("notes", {})
    assert want["modules"] and _rounded(got["modules"]) == _rounded(want["modules"])
    assert _rounded(got["params"]) == _rounded(want["params"])
    assert sum(m["elements"] for m in early["modules"]) < sum(m["elements"] for m in got["modules"])


@pytest.mark.parametrize("script", ["fp16_linear_overflow.py", "scaler_skips.py", "attention_overflow.py"])
def test_the_accelerator_layout_gives_the_cpu_layouts_findings(script, monkeypatch):
    # No GPU here: run the accelerator code paths on the CPU (a fresh block each step, strided
    # samples, rows wider than the parameter gradients' so those go through params.measure and
    # their own transfer part) and check the report says what the CPU layout says.
    from ampdoctor.trace import stats as st

    _, cpu = trace_json(script)
    real_init = st.Batch.__init__

    def accelerator_like(self, device, defer=False):
        real_init(self, device)  # not deferred: counted each step, as on an accelerator
        self.reuse = self.gather = False

    monkeypatch.setattr(st.Batch, "__init__", accelerator_like)
    monkeypatch.setattr(st, "SAMPLE_CPU", 1024)
    _, acc = trace_json(script)
    assert acc["findings"] and kinds(acc) == kinds(cpu)
    assert acc["first_nonfinite"] == cpu["first_nonfinite"]
    assert [f["message"] for f in acc["findings"]] == [f["message"] for f in cpu["findings"]]
    rows = {(m["module"], m["phase"]): m for m in cpu["modules"]}
    for m in acc["modules"]:
        c = rows[(m["module"], m["phase"])]
        assert (m["absmax"], m["calls"], m["nonfinite"] != {"nan": 0, "pinf": 0, "ninf": 0}) == \
            (c["absmax"], c["calls"], c["nonfinite"] != {"nan": 0, "pinf": 0, "ninf": 0})
    assert [(p["param"], p["absmax"], p["nonfinite_steps"]) for p in acc["params"]] == \
        [(p["param"], p["absmax"], p["nonfinite_steps"]) for p in cpu["params"]]


def test_the_accelerator_counting_methods_agree_with_bincount():
    from ampdoctor.trace import stats as st

    keys = st.bucket_keys(torch.cat([torch.randn(5000) * 10.0 ** torch.randint(-30, 30, (5000,)),
                                     torch.tensor([0.0, -0.0, float("inf"), float("nan")])]))
    keys = keys.add_(torch.randint(0, 3, keys.shape, dtype=torch.int32) * st.NBUCKETS)
    want = st._count(keys, 3 * st.NBUCKETS, "bincount")
    assert want.sum() == keys.numel()
    for how in ("index_add", "sort"):
        assert torch.equal(st._count(keys, 3 * st.NBUCKETS, how), want), how


def test_a_measured_copy_does_not_change_when_the_tensor_is_changed_in_place():
    t = torch.ones(100)
    from ampdoctor.trace import stats as st

    batch = st.Batch(t.device)
    sizes = batch.add(t)
    t.mul_(float("inf"))
    s = st.summarise("float32", batch.rows().tolist(), *sizes)
    assert s.finite and s.classes["float16"]["normal"] == 100


def test_one_transfer_per_step_and_no_per_module_syncs(monkeypatch):
    calls = {"item": 0, "tolist": 0, "cpu": 0, "bool": 0, "numpy": 0}
    originals = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "__bool__")}

    def counting(name, key):
        def f(self, *a, **k):
            calls[key] += 1
            return originals[name](self, *a, **k)
        return f

    _train(steps=1, amp=True)  # warm up outside the count
    with Tracer() as t:
        for name, key in (("item", "item"), ("tolist", "tolist"), ("cpu", "cpu"), ("__bool__", "bool")):
            monkeypatch.setattr(torch.Tensor, name, counting(name, key))
        _train(steps=4)
        monkeypatch.undo()
    assert t.transfers == 4
    assert calls == {"item": 0, "tolist": 4, "cpu": 0, "bool": 0, "numpy": 0}


def test_hooks_come_off_after_an_exception_and_keyboard_interrupt():
    from torch.nn.modules import module as nn_module

    def hook_count():
        return (len(nn_module._global_forward_hooks), len(nn_module._global_forward_pre_hooks))

    before = hook_count()
    step_before = torch.amp.GradScaler.step, torch.amp.GradScaler.update
    for exc in (RuntimeError("x"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with Tracer():
                nn.Linear(2, 2)(torch.ones(1, 2))
                raise exc
        assert hook_count() == before
        assert (torch.amp.GradScaler.step, torch.amp.GradScaler.update) == step_before


def test_no_grad_and_inference_without_optimizer():
    m = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    with Tracer() as t, torch.no_grad():
        m(torch.randn(2, 4))
    rep = t.report()
    assert rep["steps"] == 1 and all(r["phase"] == "forward" for r in rep["modules"])


def test_integer_bool_empty_and_structured_outputs_are_skipped_cleanly():
    class Odd(nn.Module):
        def forward(self, x):
            return {"ids": x.argmax(-1), "mask": x > 0, "empty": x[:0], "t": (x * 2, None, 3)}

    with Tracer() as t:
        Odd()(torch.randn(3, 4))
    row = next(r for r in t.report()["modules"] if r["module"] == "(Odd)")
    assert row["calls"] == 1 and row["dtype"] == "float32"


def test_several_roots_are_named_apart():
    a, b = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))
    with Tracer() as t:
        a(torch.ones(1, 2))
        b(torch.ones(1, 2))
    names = sorted(r["module"] for r in t.report()["modules"])
    # one model with submodules keeps bare names; a lone layer beside it gets its variable's name
    assert names == ["(Sequential)", "0", "a"]


def test_memory_is_flat_over_many_steps():
    m = nn.Linear(8, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with Tracer() as t:
        for _ in range(300):
            m(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        pending = len(t._pending)
    assert pending == 0 and t.steps == 300
    assert len(t.modules) == 2  # fixed-size aggregates, not per-step history


def test_dataclass_dict_subclass_complex_int_and_meta_outputs():
    from collections import OrderedDict

    class ModelOutputLike(OrderedDict):
        pass

    class Many(nn.Module):
        def forward(self, x):
            return Out(x * 2, {"c": torch.complex(x, x), "i": x.long(), "meta": torch.empty(3, device="meta"),
                               "nested": ModelOutputLike(h=x + 70000.0)})

    with Tracer(target="float16") as t:
        Many()(torch.ones(2, 3))
    row = next(r for r in t.report()["modules"] if r["module"] == "(Many)")
    assert row["absmax"] == 70001.0  # found inside the dataclass -> dict -> OrderedDict subclass
    assert row["dtype"] == "float32"


def test_compiled_module_is_traced_or_reported():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compiled = torch.compile(m, backend="eager")
    with Tracer() as t:
        out = compiled(torch.randn(2, 4))
    rep = t.report()
    assert torch.isfinite(out).all()
    traced = {r["module"] for r in rep["modules"]}
    # the wrapper runs eagerly and is measured; what dynamo traced inside is named as not traced
    assert traced and (rep["not_traced"] or {"0", "1"} <= {n.split(".")[-1] for n in traced})


def test_memory_is_flat_over_1000_steps():
    import resource

    m = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(8, 32)

    def steps(n):
        for _ in range(n):
            m(x).sum().backward()
            opt.step()
            opt.zero_grad()

    with Tracer() as t:
        steps(200)
        rss_200 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        steps(800)
        rss_1000 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert t.steps == 1000 and t.transfers == 1000
    assert rss_1000 - rss_200 < 20 * 1024  # KiB: no per-step growth


def test_script_with_dataloader_worker_processes(tmp_path):
    (tmp_path / "loader.py").write_text(textwrap.dedent("""\
        import torch
        from torch.utils.data import DataLoader, Dataset

        class Squares(Dataset):
            def __len__(self):
                return 16
            def __getitem__(self, i):
                return torch.full((4,), float(i))

        if __name__ == "__main__":
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            for batch in DataLoader(Squares(), batch_size=4, num_workers=2):
                model(batch).mean().backward()
                opt.step()
                opt.zero_grad()
    """))
    r = CliRunner().invoke(main, ["trace", "--format", "json", str(tmp_path / "loader.py")])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["steps"] == 4
