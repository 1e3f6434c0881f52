"""The tracer on Hugging Face transformers models built from configs (random weights, no download).

GPT-2, BERT and T5 are trained for a few steps under CPU float16 (with a GradScaler) and bfloat16
autocast, called the ways real code calls them: ``model(...)``, T5's encoder, decoder and lm_head
one by one, and ``generate()``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from ampdoctor.trace import Tracer  # noqa: E402

VOCAB = 64


def _t5(plant: bool = False):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    m = T5ForConditionalGeneration(cfg)
    if plant:  # the feed-forward output of block 1 overflows float16 (T5's well-known fp16 failure)
        with torch.no_grad():
            m.encoder.block[1].layer[1].DenseReluDense.wo.weight.mul_(1e5)
    return m


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4))


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=64,
                                                    max_position_embeddings=32, num_labels=3))


def _batch(kind):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 8), generator=g)
    if kind == "bert":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 2])}
    if kind == "t5":
        return {"input_ids": ids, "labels": torch.randint(1, VOCAB, (2, 5), generator=g)}
    return {"input_ids": ids, "labels": ids}


MAKERS = {"gpt2": _gpt2, "bert": _bert, "t5": _t5}


def _train(kind, dtype, tracer=None, steps=3):
    model = MAKERS[kind]()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    batch = _batch(kind)
    losses = []
    ctx = tracer if tracer is not None else _Null()
    with ctx:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach().clone())
    return losses, [p.detach().clone() for p in model.parameters()]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return None


def _bits(t):
    return t.reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.parametrize("kind", ["gpt2", "bert", "t5"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_healthy_hf_training_is_unchanged_and_has_no_false_alarms(kind, dtype):
    base_losses, base_params = _train(kind, dtype)
    t = Tracer()
    losses, params = _train(kind, dtype, t)
    for a, b in zip(base_losses + base_params, losses + params):
        assert torch.equal(_bits(a), _bits(b))
    rep = t.report()
    assert rep["notes"] == [] and rep["steps"] == 3
    assert rep["first_nonfinite"] is None
    assert [f for f in rep["findings"] if f["kind"] in ("nonfinite", "overflow", "scaler")] == []
    names = {r["module"] for r in rep["modules"]}
    expect = {"gpt2": {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"},
              "bert": {"bert.encoder.layer.0.attention.self.query", "bert.pooler.dense", "classifier"},
              "t5": {"encoder.block.1.layer.1.DenseReluDense.wo", "decoder.block.0.layer.1.EncDecAttention.q",
                     "lm_head"}}[kind]
    assert expect <= names
    assert not any("#" in n for n in names)


def _t5_parts_step(model, batch):
    """What generate() and custom loops do: the encoder, the decoder and the head called one by one."""
    enc = model.encoder(input_ids=batch["input_ids"]).last_hidden_state
    dec = model.decoder(input_ids=model._shift_right(batch["labels"]), encoder_hidden_states=enc)
    logits = model.lm_head(dec.last_hidden_state)
    return torch.nn.functional.cross_entropy(logits.float().view(-1, VOCAB), batch["labels"].view(-1))


@pytest.mark.parametrize("how", ["model", "parts"])
def test_t5_planted_fp16_overflow_is_blamed_on_wo_and_nothing_else(how):
    model = _t5(plant=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch("t5")
    with Tracer() as t:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss if how == "model" else _t5_parts_step(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
    rep = t.report()
    wo = "encoder.block.1.layer.1.DenseReluDense.wo"
    assert rep["first_nonfinite"]["module"] == wo and rep["first_nonfinite"]["phase"] == "forward"
    assert [(f["kind"], f["module"]) for f in rep["findings"] if f.get("origin")] == [("overflow", wo)]
    assert [r["module"] for r in rep["modules"] if r["origin"]] == [wo]


def test_t5_names_are_the_same_through_model_parts_and_generate():
    model = _t5()
    model.eval()
    batch = _batch("t5")

    def names(run):
        with Tracer() as t, torch.no_grad():
            run()
        return {r["module"] for r in t.report()["modules"]}, t.report()

    whole, _ = names(lambda: model(**batch))
    parts, _ = names(lambda: _t5_parts_step(model, batch))
    gen, rep = names(lambda: model.generate(batch["input_ids"], max_new_tokens=3, do_sample=False))
    assert {n for n in parts} <= whole | {"(CrossEntropyLoss)"}
    assert "encoder.block.0.layer.0.SelfAttention.q" in gen and "lm_head" in gen
    assert {n for n in gen if not n.startswith("(")} <= whole
    assert rep["steps"] >= 3  # one step per decoding forward


def test_bert_cross_attention_style_kwargs_and_eval_under_inference_mode():
    model = _bert().eval()
    batch = _batch("bert")
    with torch.inference_mode():
        want = model(**batch).logits
    with Tracer() as t, torch.inference_mode():
        got = model(**batch).logits
    assert torch.equal(want, got)
    rep = t.report()
    assert rep["notes"] == [] and rep["findings"] == []
    assert any(r["module"] == "bert.encoder.layer.1.output.dense" for r in rep["modules"])
