"""--compare fp32: a layer that loses its digits in float16 is ranked first, healthy layers keep
their format's precision, and the run's results do not change at all."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from ampdoctor.cli import main  # noqa: E402
from ampdoctor.trace import Tracer  # noqa: E402
from conftest import FIXTURES, trace_fixture  # noqa: E402

SCRIPT = FIXTURES / "trace" / "compare_lossy_shift.py"


def test_the_layer_that_loses_digits_is_ranked_first_and_healthy_ones_lose_none():
    r = CliRunner().invoke(main, ["trace", "--compare", "fp32", "--format", "json", str(SCRIPT)])
    assert r.exit_code == 0, r.output
    cmp = json.loads(r.stdout)["compare"]
    assert cmp["reference"] == "float32" and cmp["format_bits"] == 11
    layers = {row["module"]: row for row in cmp["layers"]}
    first = cmp["layers"][0]
    assert first["module"] == "shift" and first["bits_lost"] > 8 and "advice" in first
    assert first["own_rel_err"] > 0.5 and first["calls"] == 3
    # the Linear layers round like any float16 result: about 2**-11, nothing lost
    assert layers["fc1"]["bits_lost"] == 0 and layers["fc1"]["own_rel_err"] < 2e-3
    # fc2 adds little itself but carries what `shift` lost
    assert layers["fc2"]["own_rel_err"] < 2e-3 < 0.1 < layers["fc2"]["rel_err_median"]
    assert layers["(Net)"]["container"] is True and cmp["layers"][-1]["module"] == "(Net)"


def test_the_text_report_lists_the_worst_layers_and_advice():
    r = CliRunner().invoke(main, ["trace", "--compare", "fp32", "--width", "80", str(SCRIPT)])
    lines = r.output.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("precision against float32"))
    assert lines[at + 2].split()[:2] == ["shift", "Shift"]
    assert re.search(r"`shift` loses \d+(\.\d)? of float16's 11 bits itself", " ".join(lines[at:]))
    assert all(len(ln) <= 80 for ln in lines[at:])


def test_the_html_report_shows_the_comparison(tmp_path):
    out = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["trace", "--compare", "fp32", "-o", str(out), str(SCRIPT)])
    assert r.exit_code == 0, r.output
    page = out.read_text("utf-8")
    assert "<h2>Precision against float32 (float16: 11 bits)</h2>" in page
    section = page[page.index("Precision against float32"):page.index("<h2>Layers</h2>")]
    cells = re.findall(r"<tr[^>]*><td>([^<]*)</td>", section)
    assert cells[0] == "shift" and cells[-1] == "(Net)"  # worst first, the container last
    assert "loses" in section and "bits" in section  # the advice for the worst layer


def test_comparing_changes_nothing_bitwise():
    mod = trace_fixture("compare_lossy_shift")
    model, outs = mod.train(steps=3)
    with Tracer(compare="float32") as t:
        cmodel, couts = mod.train(steps=3)
    assert t.report()["compare"]["layers"]  # it compared (BatchNorm and dropout re-run in train mode)
    assert all(torch.equal(a, b) for a, b in zip(outs, couts))  # outputs and gradients
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), cmodel.state_dict().values()))


def test_watch_and_compare_are_refused_together():
    r = CliRunner().invoke(main, ["trace", "--compare", "fp32", "--watch", str(SCRIPT)])
    assert r.exit_code == 2 and "--watch and --compare do not go together" in r.output


def test_a_module_that_loses_digits_between_its_children_is_ranked_as_a_layer():
    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(16, 16)

        def forward(self, x):
            return (self.inner(x) + 2048.0) - 2048.0  # its own code, not a child, loses the digits

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Wrapped(), torch.nn.Linear(16, 1))
    with Tracer(compare="float32") as t:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                model(torch.randn(8, 16)).float().sum().backward()
    rows = t.report()["compare"]["layers"]
    assert rows[0]["class"] == "Wrapped" and rows[0]["container"] is False and rows[0]["bits_lost"] > 8
    assert next(r for r in rows if r["class"] == "Sequential")["container"] is True


def test_a_module_that_changes_its_inputs_in_place_is_compared_on_them_as_they_were():
    """`x.add_(1)` and ReLU(inplace=True): the re-runs start from copies taken before the real
    call, so the in-place layer loses nothing, and the re-runs never touch the run's own tensors
    (a float32 input the re-run changed in place would change the results)."""
    class Shift(torch.nn.Module):
        def forward(self, x):
            return x.add_(1.0)

    class ScaleFloat32(torch.nn.Module):  # autocast leaves mul_ alone: its input stays float32
        def forward(self, x):
            return x.mul_(0.5)

    def run(tracer):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), Shift(), torch.nn.ReLU(inplace=True),
                                    torch.nn.Linear(32, 4))
        scale = ScaleFloat32()
        outs = []
        with tracer:
            for _ in range(3):
                x = torch.randn(8, 16)
                with torch.autocast("cpu", dtype=torch.float16):
                    y = model(scale(x))
                y.float().pow(2).mean().backward()
                outs += [x.clone(), y.detach().clone(), *(p.grad.clone() for p in model.parameters())]
                model.zero_grad()
        return outs

    import contextlib
    plain = run(contextlib.nullcontext())
    t = Tracer(compare="float32")
    compared = run(t)
    assert all(torch.equal(a, b) for a, b in zip(plain, compared))
    rows = {r["class"]: r for r in t.report()["compare"]["layers"]}
    assert rows["Shift"]["bits_lost"] == 0 and rows["Shift"]["own_rel_err"] < 2e-3
    assert rows["ReLU"]["own_rel_err"] == 0
    assert rows["ScaleFloat32"]["own_rel_err"] == 0  # float32 in, float32 out: exact
