"""What a finding says about the configuration it depends on: the mode that enables the scaler,
the setting that makes a dtype bfloat16. The short messages are pinned by the snapshots; these
check the explanations users read under them."""

from __future__ import annotations

import textwrap

from conftest import lint_text


def _explanations(src: str, code: str) -> list[str]:
    res = lint_text(textwrap.dedent(src), enabled={code})
    return [d.explanation for d in res.diagnostics if d.code == code]


def test_checkpoint_finding_names_the_if_that_makes_the_scaler():
    src = '''
        import torch

        def train(opt, model, optimizer, loader):
            if opt.mixed_precision is True:
                scaler = torch.amp.GradScaler("cuda")
            else:
                scaler = None
            if opt.resume:
                optimizer.load_state_dict(torch.load("state.pth")["optimizer"])
            for x in loader:
                with torch.autocast("cuda", enabled=scaler is not None):
                    loss = model(x)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "state.pth")
    '''
    (text,) = _explanations(src, "AMP110")
    assert text.startswith("The scaler is enabled when `opt.mixed_precision is True`, and a run resumed")


def test_scaler_on_for_every_dtype_names_the_setting_that_picks_bfloat16():
    src = '''
        import torch

        def train(args, model, optimizer, loader):
            scaler = torch.amp.GradScaler("cuda")
            precision = torch.float16 if args.mix_precision == "fp16" else torch.bfloat16
            for x in loader:
                with torch.autocast("cuda", dtype=precision):
                    loss = model(x)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
    '''
    (text,) = _explanations(src, "AMP108")
    assert text.startswith("It is always enabled, whatever the dtype, and the autocast's `dtype=precision` can be "
                           "bfloat16.")
