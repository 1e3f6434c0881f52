"""Tracing jobs of several processes: torchrun/DDP on gloo (2 CPU ranks, in subprocesses), the
merge of the ranks' reports, and the Hugging Face and Lightning callbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from ampdoctor.trace import distributed as dt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DDP = str(ROOT / "fixtures" / "trace" / "ddp_rank1_overflow.py")
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "AMPDOCTOR_RUN_DIR", "AMPDOCTOR_MERGE")


def _env():
    """The test runner's environment without what an earlier in-process run may have left of a
    launcher's variables (a process group of one sets RANK/MASTER_PORT)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    return dict(env, OMP_NUM_THREADS="1", NO_COLOR="1", COLUMNS="100")


def _trace(tmp_path, *args, launcher=True):
    out = tmp_path / "report.json"
    if launcher:
        cmd = [sys.executable, "-m", "ampdoctor", "trace", "--nproc-per-node", "2", "--standalone",
               "--format", "json", "-o", str(out), DDP, *args]
    else:  # a bare torchrun running ampdoctor on every rank: rank 0 merges
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               "-m", "ampdoctor", "trace", "--format", "json", "-o", str(out), DDP, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=240)
    report = json.loads(out.read_text()) if out.exists() else None
    return p, report


def test_rank_1_overflowing_at_step_2_is_named_with_its_layer(tmp_path):
    p, r = _trace(tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    # the terminal gets the merged verdict: the rank, the step and the layer
    assert "NaN/Inf first appeared in `0` (forward, step 2, rank 1)." in p.stdout
    first = r["first_nonfinite"]
    assert (first["rank"], first["step"], first["module"], first["phase"]) == (1, 2, "0", "forward")
    assert r["world_size"] == 2 and [x["rank"] for x in r["ranks"]] == [0, 1]
    assert all(x["status"] == "ok" and x["steps"] == 5 for x in r["ranks"])
    # the all-reduce gave rank 0 the inf gradients too: both ranks' GradScalers skipped step 2
    assert [x["skipped_steps"] for x in r["ranks"]] == [[2], [2]]
    assert r["ranks"][0]["first_nonfinite"]["phase"] == "param"
    origin = [f for f in r["findings"] if f.get("origin")]
    assert len(origin) == 1 and origin[0]["rank"] == 1 and origin[0]["module"] == "0"
    follows = [f for f in r["findings"] if f.get("follows")]
    assert follows and all(f["rank"] == 0 and f["follows"] == {"rank": 1, "step": 2} for f in follows)
    row = next(m for m in r["modules"] if (m["module"], m["phase"]) == ("0", "forward"))
    assert row["origin"] and row["rank"] == 1
    assert row["ranks"]["0"]["nonfinite"] == 0 and row["ranks"]["1"]["nonfinite"] > 0
    assert all("rank" in m for m in r["modules"]) and all("rank" in f for f in r["findings"])
    # DDP's wrapper adds no `module.` to the names; the report says which gradients it shows
    assert not any(m["module"].startswith("module.") for m in r["modules"])
    assert r["distributed"]["module_gradients"].startswith("local, before the all-reduce")


def test_healthy_ddp_run_under_a_bare_torchrun_is_merged_by_rank_0(tmp_path):
    p, r = _trace(tmp_path, "--fault", "none", launcher=False)
    assert p.returncode == 0, p.stderr
    assert "No numerical problems found in 5 step(s)" in p.stdout
    assert r["findings"] == [] and r["first_nonfinite"] is None
    assert [(x["rank"], x["status"], x["skipped_steps"]) for x in r["ranks"]] == [(0, "ok", []), (1, "ok", [])]
    # every rank measured the same layers; the merged row holds both ranks' values
    row = next(m for m in r["modules"] if (m["module"], m["phase"]) == ("0", "forward"))
    assert set(row["ranks"]) == {"0", "1"} and row["absmax"] == max(v["absmax"] for v in row["ranks"].values())
    assert r["script"]["run_dir"] is None  # the default run folder is removed once merged


def test_a_rank_that_raises_keeps_the_other_ranks_data(tmp_path):
    p, r = _trace(tmp_path, "--fault", "raise")
    assert p.returncode != 0 and r is not None, p.stderr[-3000:]
    assert r["ranks"][1]["status"] == "raised" and "a bad batch at step 2" in r["ranks"][1]["error_summary"]
    assert r["ranks"][0]["steps"] >= 2  # rank 0's steps before the failure are still reported
    assert r["script"]["error_summary"].startswith("rank 1: RuntimeError: rank 1: a bad batch")
    assert "The script failed (rank 1: RuntimeError: rank 1: a bad batch at step 2)" in " ".join(p.stdout.split())


def test_a_killed_rank_is_reported_missing(tmp_path):
    p, r = _trace(tmp_path, "--fault", "kill")
    assert p.returncode != 0 and r is not None, p.stderr[-3000:]
    assert r["ranks"][1]["status"] == "missing" and r["distributed"]["missing_ranks"] == [1]
    assert r["ranks"][0]["steps"] >= 2
    assert "ended without a report" in r["script"]["error_summary"]


def test_launcher_options_need_nproc_per_node(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "trace", "--nnodes", "2", DDP],
                       capture_output=True, text=True, env=_env())
    assert p.returncode == 2 and "--nnodes needs --nproc-per-node" in p.stderr and "Traceback" not in p.stderr


# -- merging, without processes ---------------------------------------------------------------

def _row(module, phase, absmax, nonfinite=0, step=None):
    return {"module": module, "class": "Linear", "phase": phase, "dtype": "float16", "calls": 2,
            "absmax": absmax, "min_nonzero": 1e-3, "nonfinite": {"nan": nonfinite, "pinf": 0, "ninf": 0},
            "overflow_fraction": 0.0, "underflow_fraction": 0.0, "zero_fraction": 0.0, "headroom_bits": 3.0,
            "first_nonfinite_step": step, "origin": False, "elements": 10.0, "absmax_by_step": [[0, absmax]]}


def _report(rows, first=None, findings=(), skipped=()):
    return {"version": "x", "target_dtype": "float16", "dtypes_seen": ["float16"], "steps": 4, "optimizer_steps": 4,
            "transfers": 4, "modules_ran": True, "findings": list(findings), "first_nonfinite": first,
            "op_origin": None, "modules": rows, "params": [], "loss": None,
            "scaler": {"steps": [{"step": s, "skipped": s in skipped} for s in range(4)]},
            "not_traced": [], "skipped_tensors": {}, "notes": [], "script": {"exit_code": 0, "error": None}}


def test_merge_picks_the_earliest_step_then_forward_then_rank():
    fwd = {"module": "a", "phase": "forward", "step": 3}
    param = {"module": None, "phase": "param", "step": 3, "params": ["a.weight"]}
    early = {"module": "b", "phase": "backward", "step": 1}
    m = dt.merge({0: _report([_row("a", "forward", 1.0)], param), 1: _report([_row("a", "forward", 2.0)], fwd)}, 2)
    assert m["first_nonfinite"]["rank"] == 1 and m["first_nonfinite"]["phase"] == "forward"
    m = dt.merge({0: _report([], early), 1: _report([], fwd), 2: None}, 3)
    assert m["first_nonfinite"]["rank"] == 0 and m["first_nonfinite"]["step"] == 1
    assert m["ranks"][2]["status"] == "missing" and m["distributed"]["missing_ranks"] == [2]


def test_merge_keeps_per_rank_ranges_and_the_rank_of_the_maximum():
    m = dt.merge({0: _report([_row("a", "forward", 5.0)]), 1: _report([_row("a", "forward", 9.0)])}, 2)
    row = m["modules"][0]
    assert (row["absmax"], row["absmax_min"], row["rank"], row["calls"]) == (9.0, 5.0, 1, 4)
    assert row["ranks"] == {"0": {"absmax": 5.0, "nonfinite": 0}, "1": {"absmax": 9.0, "nonfinite": 0}}
    # a rank holding NaN/Inf outranks a larger finite maximum
    m = dt.merge({0: _report([_row("a", "forward", 9.0)]), 1: _report([_row("a", "forward", 1.0, 3, 2)])}, 2)
    assert m["modules"][0]["rank"] == 1 and m["modules"][0]["nonfinite"]["nan"] == 3


def test_merge_lists_each_finding_once_with_every_rank_that_had_it():
    f = {"kind": "scaler", "module": None, "phase": "backward", "step": 2, "message": "skipped"}
    m = dt.merge({0: _report([], findings=[f], skipped=[2]), 1: _report([], findings=[dict(f)], skipped=[2])}, 2)
    assert len(m["findings"]) == 1 and m["findings"][0]["ranks"] == [0, 1] and m["findings"][0]["rank"] == 0
    assert [r["skipped_steps"] for r in m["ranks"]] == [[2], [2]]


def test_rank_reports_are_written_atomically_and_read_back(tmp_path):
    info = dt.RankInfo(rank=1, world_size=2, local_rank=1, run_id="t")
    dt.write_rank_report(str(tmp_path), info, _report([]))
    got = dt.read_rank_reports(str(tmp_path), 2)
    assert got[0] is None and got[1]["rank"] == 1 and got[1]["world_size"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["rank-1.json"]
    assert dt.rank_info({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).rank == 1
    assert dt.rank_info({"RANK": "0", "WORLD_SIZE": "1"}) is None and dt.rank_info({}) is None


# -- framework callbacks ----------------------------------------------------------------------

def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers, transformers.GPT2LMHeadModel(cfg)


def test_transformers_trainer_callback_writes_the_report(tmp_path):
    transformers, model = _tiny_gpt2()
    from ampdoctor.integrations.transformers import AmpDoctorCallback

    data = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))} for _ in range(8)]
    cb = AmpDoctorCallback(str(tmp_path / "amp.json"))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                                          use_cpu=True, bf16=True, report_to=[], logging_strategy="no",
                                          save_strategy="no", disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    r = json.loads((tmp_path / "amp.json").read_text())
    assert r["optimizer_steps"] == 3 and r["target_dtype"] == "bfloat16" and "bfloat16" in r["dtypes_seen"]
    names = {m["module"] for m in r["modules"]}
    assert "transformer.h.0.attn.c_attn" in names and "transformer.h.1.mlp.c_fc" in names
    assert cb.report is not None and cb.report["steps"] == r["steps"]


def test_ampdoctor_trace_runs_a_trainer_script_unchanged(tmp_path):
    _tiny_gpt2()
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
        data = [{"input_ids": torch.randint(0, 64, (16,)), "labels": torch.randint(0, 64, (16,))} for _ in range(8)]
        args = TrainingArguments(output_dir="out", max_steps=3, per_device_train_batch_size=2, use_cpu=True,
                                 bf16=True, report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True)
        Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=data).train()
    '''))
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "trace", "--format", "json", str(script)],
                       capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=240)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["optimizer_steps"] == 3 and any(m["module"] == "transformer.h.0.attn.c_attn" for m in r["modules"])


def test_lightning_callback_writes_the_report(tmp_path):
    L = pytest.importorskip("lightning")
    from torch import nn

    from ampdoctor.integrations.lightning import AmpDoctorCallback

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ds = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    cb = AmpDoctorCallback(str(tmp_path / "amp.html"))
    L.Trainer(max_steps=4, accelerator="cpu", precision="bf16-mixed", callbacks=[cb], logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=str(tmp_path)).fit(Regressor(), torch.utils.data.DataLoader(ds, batch_size=8))
    html = (tmp_path / "amp.html").read_text()
    assert html.lower().startswith("<!doctype html>") and "net.0" in html
    # Lightning keeps weakref proxies of the trainer: naming must not trip over them
    assert cb.report["optimizer_steps"] == 4 and not cb.report["notes"]


def test_fsdp_parameters_keep_their_names_or_the_report_says_why_not(tmp_path):
    """FSDP over gloo on the CPU: with use_orig_params=True the parameters and modules keep the
    model's names (no `_fsdp_wrapped_module`); with flattened parameters the report says it can
    only name `_flat_param`."""
    script = tmp_path / "fsdp_train.py"
    script.write_text(textwrap.dedent('''
        import sys
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        dist.init_process_group("gloo")
        torch.manual_seed(0)
        orig = sys.argv[1] == "orig"
        model = FSDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), use_orig_params=orig,
                     device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        dist.destroy_process_group()
    '''))
    for mode in ("orig", "flat"):
        out = tmp_path / f"{mode}.json"
        p = subprocess.run([sys.executable, "-m", "ampdoctor", "trace", "--nproc-per-node", "2", "--standalone",
                            "-o", str(out), str(script), mode], capture_output=True, text=True, env=_env(),
                           cwd=tmp_path, timeout=240)
        assert p.returncode == 0, p.stderr
        r = json.loads(out.read_text())
        names = {m["module"] for m in r["modules"]}
        assert {"0", "1", "2"} <= names and not any("_fsdp" in n for n in names)
        params = [x["param"] for x in r["params"]]
        if mode == "orig":
            assert sorted(params) == ["0.bias", "0.weight", "2.bias", "2.weight"]
            assert not any("flat" in n for n in r["notes"])
        else:
            assert params == ["_flat_param"] and any("use_orig_params=True" in n for n in r["notes"])
