"""Defects in code nothing in the project uses are left out, and the run says so."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from click.testing import CliRunner

from ampdoctor.cli import main

LOOP = textwrap.dedent('''
    def {name}(model, opt, loader):
        scaler = torch.amp.GradScaler("cuda")
        for x in loader:
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
''')


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, src in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src, "utf-8")


def _lint(root: Path, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["lint", "--no-cache", *args, str(root)], catch_exceptions=False)
    return r.exit_code, r.output


def _project(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / ".git").mkdir()
    _write(tmp_path, files)
    return tmp_path


def test_a_helper_nobody_calls_is_left_out_and_the_summary_says_so(tmp_path):
    root = _project(tmp_path, {
        "lib/loops.py": "import torch\n" + LOOP.format(name="fit") + LOOP.format(name="old_fit"),
        "train.py": "from lib.loops import fit\nfit(None, None, [])\n",
    })
    code, out = _lint(root, "--format", "json")
    assert code == 1
    doc = json.loads(out)
    assert [(Path(d["path"]).name, d["line"], d["code"]) for d in doc["diagnostics"]] == [("loops.py", 7, "AMP101")]
    assert [(u["code"], u["line"], u["definition"]) for u in doc["unreferenced"]] == [("AMP101", 13, "old_fit")]

    code, out = _lint(root)
    assert "1 finding in code that nothing outside tests uses not shown (old_fit); " \
           "--include-unreferenced shows it." in out
    code, out = _lint(root, "--include-unreferenced", "--format", "json")
    assert [d["line"] for d in json.loads(out)["diagnostics"]] == [7, 13]


def test_config_key_includes_unreferenced_code(tmp_path, monkeypatch):
    root = _project(tmp_path, {
        "pyproject.toml": "[tool.ampdoctor]\ninclude-unreferenced = true\n",
        "loops.py": "import torch\n" + LOOP.format(name="fit") + LOOP.format(name="old_fit"),
        "train.py": "from loops import fit\nfit(None, None, [])\n",
    })
    monkeypatch.chdir(root)
    res = CliRunner().invoke(main, ["lint", "--no-cache", "--format", "json", "."], catch_exceptions=False)
    assert [d["line"] for d in json.loads(res.output)["diagnostics"]] == [7, 13]
    (root / "pyproject.toml").write_text("[tool.ampdoctor]\ninclude-unreferenced = 1\n", "utf-8")
    r = CliRunner().invoke(main, ["lint", "--no-cache", "."])
    assert r.exit_code == 2 and "'include-unreferenced' must be true or false" in r.output


def test_a_standalone_file_keeps_every_finding(tmp_path):
    """A snippet or a script none of whose definitions is used: its entry points are unknown."""
    root = _project(tmp_path, {"snippet.py": "import torch\n" + LOOP.format(name="fit") + LOOP.format(name="other")})
    code, out = _lint(root, "--format", "json")
    assert [d["line"] for d in json.loads(out)["diagnostics"]] == [7, 13]


def test_uses_that_count(tmp_path):
    """A name in a config file, a registry decorator, a subclass that is used, an __init__ re-export."""
    root = _project(tmp_path, {
        "pkg/__init__.py": "from .exported import Exported\n",
        "pkg/exported.py": "import torch\nclass Exported:\n" + textwrap.indent(LOOP.format(name="fit"), "    "),
        "pkg/models.py": "import torch\nfrom pkg.registry import MODELS\n"
                         "class Base:\n" + textwrap.indent(LOOP.format(name="fit"), "    ")
                         + "class Child(Base):\n    pass\n"
                         "@MODELS.register_module()\nclass Registered:\n" + textwrap.indent(LOOP.format(name="fit"), "    ")
                         + "class FromYaml:\n" + textwrap.indent(LOOP.format(name="fit"), "    ")
                         + "class Dead:\n" + textwrap.indent(LOOP.format(name="fit"), "    "),
        "pkg/registry.py": "MODELS = {}\n",
        "configs/run.yaml": "model:\n  type: FromYaml\n",
        "train.py": "from pkg.models import Child\nChild()\n",
    })
    code, out = _lint(root, "--format", "json")
    doc = json.loads(out)
    kept = sorted((Path(d["path"]).name, d["line"]) for d in doc["diagnostics"])
    assert [u["definition"] for u in doc["unreferenced"]] == ["Dead"]
    assert len(kept) == 4 and ("exported.py", 8) in kept


def test_uses_from_tests_only_do_not_count_for_product_code(tmp_path):
    root = _project(tmp_path, {
        "pkg/ops.py": "import torch\n" + LOOP.format(name="fit") + LOOP.format(name="tested_only")
                      + "\ndef _test_self():\n    tested_only(None, None, [])\n"
                      + "\nif __name__ == '__main__':\n    _test_self()\n",
        "tests/test_ops.py": "from pkg.ops import tested_only\n\ndef test_it():\n    tested_only(None, None, [])\n",
        "train.py": "from pkg.ops import fit\nfit(None, None, [])\n",
    })
    code, out = _lint(root, "--format", "json")
    doc = json.loads(out)
    assert [u["definition"] for u in doc["unreferenced"]] == ["tested_only"]
    assert [(Path(d["path"]).name, d["line"]) for d in doc["diagnostics"]] == [("ops.py", 7)]


def test_a_private_method_nobody_calls_and_deprecations_everywhere(tmp_path):
    root = _project(tmp_path, {
        "trainer.py": "import torch\nclass Trainer:\n"
                      "    def run(self, loader):\n        self._step(loader)\n"
                      + textwrap.indent(LOOP.format(name="_step").replace("(model,", "(self, model,"), "    ")
                      + textwrap.indent(LOOP.format(name="_old_step").replace("(model,", "(self, model,"), "    ")
                      + "class Unused:\n    def f(self):\n        return torch.cuda.amp.GradScaler()\n",
        "train.py": "from trainer import Trainer\nTrainer().run([])\n",
    })
    code, out = _lint(root, "--format", "json")
    doc = json.loads(out)
    assert [u["definition"] for u in doc["unreferenced"]] == ["Trainer._old_step"]
    codes = sorted(d["code"] for d in doc["diagnostics"])
    assert codes == ["AMP101", "AMP501"]  # the deprecation is reported in unused code too


def test_a_package_module_nothing_imports_is_left_out_whole(tmp_path):
    """A copy left beside the real module (`modeling_llama_.py`): nothing imports or names it."""
    body = "import torch\n" + LOOP.format(name="fit")
    root = _project(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/loops.py": body,
        "pkg/loops_old.py": body,
        "pkg/script.py": body + "\nif __name__ == '__main__':\n    pass\n",
        "train.py": "from pkg.loops import fit\nfit(None, None, [])\n",
    })
    code, out = _lint(root, "--format", "json")
    doc = json.loads(out)
    assert sorted(Path(d["path"]).name for d in doc["diagnostics"]) == ["loops.py", "script.py"]
    assert [u["definition"] for u in doc["unreferenced"]] == ["loops_old.py (never imported)"]
    # named in a shell script or a config: no longer unused
    (root / "run.sh").write_text("python -c 'import pkg.loops_old'\n", "utf-8")
    code, out = _lint(root, "--format", "json")
    assert sorted(Path(d["path"]).name for d in json.loads(out)["diagnostics"]) == ["loops.py", "loops_old.py",
                                                                                     "script.py"]


def test_example_code_in_a_docs_folder_is_left_out(tmp_path):
    root = _project(tmp_path, {
        "docs/profiling/workload.py": "import torch\n" + LOOP.format(name="run") + "run(None, None, [])\n",
        "src/train.py": "import torch\n" + LOOP.format(name="fit") + "fit(None, None, [])\n",
    })
    code, out = _lint(root, "--format", "json")
    doc = json.loads(out)
    assert [Path(d["path"]).name for d in doc["diagnostics"]] == ["train.py"]
    assert [(u["code"], u["definition"]) for u in doc["unreferenced"]] == [("AMP101", "docs/ (documentation)")]
    code, out = _lint(root)
    assert "in code that nothing outside tests uses or in documentation folders not shown" in out


def test_helpers_of_a_test_folder_count_as_tests(tmp_path):
    from conftest import lint_text

    src = textwrap.dedent('''
        import torch

        def check_step(model, opt, x):
            scaler = torch.amp.GradScaler("cuda")
            with torch.autocast("cuda"):
                scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
            scaler.update()
    ''')
    assert [d.code for d in lint_text(src, "models/common/optimization.py").diagnostics] == ["AMP312"]
    assert [d.code for d in lint_text(src, "test/models/common/optimization.py").diagnostics] == []


def test_a_script_importing_a_module_the_project_no_longer_has_is_left_out(tmp_path):
    """ColossalChat's community example imports `coati.models.bloom`, which its `coati` lost in a
    refactoring: the script cannot run, so its findings cannot happen. Imports that resolve, a
    compiled extension beside the package, optional imports in `try` and other projects' packages
    keep their findings."""
    fp16 = "actor = Actor().to(torch.float16)\noptim = Adam(actor.parameters(), lr=1e-5)\n"
    root = _project(tmp_path, {
        "coati/__init__.py": "", "coati/models/__init__.py": "", "coati/models/base.py": "",
        "coati/ops/nms.pyx": "",
        "examples/old.py": "import torch\nfrom torch.optim import Adam\nfrom coati.models.bloom import Actor\n" + fp16,
        "examples/new.py": "import torch\nfrom torch.optim import Adam\nfrom coati.models.base import Actor\n" + fp16,
        "examples/ext.py": "import torch\nfrom torch.optim import Adam\nfrom coati.ops.nms import Actor\n" + fp16,
        "examples/opt.py": "import torch\nfrom torch.optim import Adam\ntry:\n    from coati.models.bloom import Actor\n"
                           "except ImportError:\n    from coati.models.base import Actor\n" + fp16,
        "examples/other.py": "import torch\nfrom torch.optim import Adam\nfrom peft.tuners.lora import Actor\n" + fp16,
    })
    code, out = _lint(root, "--format", "json")
    doc = json.loads(out)
    kept = sorted({Path(d["path"]).name for d in doc["diagnostics"]})
    assert kept == ["ext.py", "new.py", "opt.py", "other.py"]
    assert {u["definition"] for u in doc["unreferenced"]} == {
        "old.py (imports coati.models.bloom, which the project lacks)"}
    code, out = _lint(root)
    assert "in scripts that import modules the project no longer has not shown" in " ".join(out.split())


CKPT_TRAINER = textwrap.dedent('''
    import torch


    class Trainer{base}:
        def __init__(self, model, opt):
            self.model, self.opt = model, opt
            self.scaler = torch.amp.GradScaler("cuda")

        def fit(self, loader):
            for x in loader:
                with torch.autocast("cuda"):
                    loss = self.model(x).sum()
                self.scaler.scale(loss).backward()
                self.scaler.step(self.opt)
                self.scaler.update()
            torch.save({{"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}}, "last.pt")

        def {resume}(self, path):
            ckpt = torch.load(path)
            self.model.load_state_dict(ckpt["model"])
            self.opt.load_state_dict(ckpt["optimizer"])
''')


def test_a_checkpoint_finding_whose_only_resume_path_is_never_called_is_left_out(tmp_path):
    # the scaler-less checkpoint matters only for a resumed run; nothing calls the resume method
    root = _project(tmp_path, {
        "trainer.py": CKPT_TRAINER.format(base="", resume="resume_checkpoint"),
        "run.py": "from trainer import Trainer\nTrainer(None, None).fit([])\n",
    })
    code, out = _lint(root, "--format", "json")
    doc = json.loads(out)
    assert doc["diagnostics"] == []
    assert [(u["code"], u["line"], u["definition"], u["reason"]) for u in doc["unreferenced"]] == [
        ("AMP110", 17, "Trainer.resume_checkpoint, the code it depends on", "premise")]
    code, out = _lint(root)
    assert code == 0
    assert "(Trainer.resume_checkpoint, the code it depends on)" in " ".join(out.split())


def test_a_called_resume_path_or_a_framework_base_keeps_the_checkpoint_finding(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    called = _project(tmp_path / "a", {
        "trainer.py": CKPT_TRAINER.format(base="", resume="resume_checkpoint"),
        "run.py": "from trainer import Trainer\nt = Trainer(None, None)\nt.resume_checkpoint('x.pt')\nt.fit([])\n",
    })
    # a base class from elsewhere (a framework) may call any method
    hooked = _project(tmp_path / "b", {
        "trainer.py": CKPT_TRAINER.format(base="(BaseTrainer)", resume="restore").replace(
            "import torch\n", "import torch\nfrom framework import BaseTrainer\n", 1),
        "run.py": "from trainer import Trainer\nTrainer(None, None).fit([])\n",
    })
    for root in (called, hooked):
        code, out = _lint(root, "--format", "json")
        doc = json.loads(out)
        assert [d["code"] for d in doc["diagnostics"]] == ["AMP110"], root
        assert doc["unreferenced"] == []


def test_benchmark_and_legacy_folders_are_left_out(tmp_path):
    root = _project(tmp_path, {
        "benchmarks/attn.py": "import torch\n" + LOOP.format(name="run") + "run(None, None, [])\n",
        "legacy/train_v1.py": "import torch\n" + LOOP.format(name="run") + "run(None, None, [])\n",
        "src/train.py": "import torch\n" + LOOP.format(name="fit") + "fit(None, None, [])\n",
    })
    code, out = _lint(root, "--format", "json")
    doc = json.loads(out)
    assert [Path(d["path"]).name for d in doc["diagnostics"]] == ["train.py"]
    assert sorted((u["definition"], u["reason"]) for u in doc["unreferenced"]) == [
        ("benchmarks/ (benchmark)", "folder"), ("legacy/ (legacy code)", "folder")]
    code, out = _lint(root)
    assert "2 findings in code that nothing outside tests uses or in benchmark and legacy code folders not shown" in out


GAN_TRAINER = textwrap.dedent('''
    import torch


    class Trainer:
        def __init__(self, gen, opt):
            self.gen, self.opt = gen, opt
            self.scaler = torch.amp.GradScaler("cuda")

        def gen_update(self, x):
            self.opt.zero_grad()
            with torch.autocast("cuda"):
                loss = self.gen(x).mean()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
''')


def test_a_step_whose_update_a_training_script_calls_is_left_out(tmp_path):
    # sim2real-lane-detection: the trainer steps; train.py calls `trainer.scaler.update()` per iteration
    root = _project(tmp_path, {
        "trainers/gan.py": GAN_TRAINER,
        "train.py": ("from trainers.gan import Trainer\ntrainer = Trainer(None, None)\n"
                     "for x in []:\n    trainer.gen_update(x)\n    trainer.scaler.update()\n"),
    })
    code, out = _lint(root, "--format", "json")
    doc = json.loads(out)
    assert doc["diagnostics"] == []
    assert [(u["code"], u["line"], u["definition"], u["reason"]) for u in doc["unreferenced"]] == [
        ("AMP101", 15, "scaler.update() in train.py", "elsewhere")]
    code, out = _lint(root)
    assert code == 0 and "whose missing call another file makes not shown (scaler.update() in train.py)" in \
        " ".join(out.split())
    # nobody updates it: reported
    (root / "train.py").write_text("from trainers.gan import Trainer\nTrainer(None, None).gen_update(None)\n")
    code, out = _lint(root, "--format", "json")
    assert [(d["code"], d["line"]) for d in json.loads(out)["diagnostics"]] == [("AMP101", 15)]


def test_a_definition_found_by_a_name_built_at_run_time_is_used(tmp_path):
    # RecBole: getattr(importlib.import_module("pkg.trainer"), model_name + "Trainer")
    classes = "".join(f"\n\nclass {n}:\n    def fit(self, model, opt, loader):\n"
                      "        scaler = torch.amp.GradScaler(\"cuda\")\n        for x in loader:\n"
                      "            scaler.scale(model(x).sum()).backward()\n            scaler.step(opt)\n"
                      for n in ("NCLTrainer", "NCLRunner"))
    root = _project(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/trainer.py": "import torch" + classes,
        "pkg/utils.py": "import importlib\n\n\ndef get_trainer(name):\n"
                        "    return getattr(importlib.import_module('pkg.trainer'), name + \"Trainer\")\n",
        "run.py": "from pkg.utils import get_trainer\nget_trainer('NCL')().fit(None, None, [])\n",
    })
    doc = json.loads(_lint(root, "--format", "json")[1])
    # the trainer is looked up by its suffix; the runner, which nothing names, stays left out
    assert [(d["line"], d["code"]) for d in doc["diagnostics"]] == [(8, "AMP101")]
    assert [(u["line"], u["definition"]) for u in doc["unreferenced"]] == [(16, "NCLRunner")]
