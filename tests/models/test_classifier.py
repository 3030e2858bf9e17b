"""Text classifiers: registry and saving, exactness under padding, pooling, gradients,
learning a toy task, and the errors bad inputs get."""

import pytest
import torch
from torch.func import functional_call

from srupp.models import (CausalLM, ClassifierConfig, SequenceClassifier, SRUppClassifierConfig,
                          build_model, config_from_dict, load_model)
from srupp.models.classifier import POOLINGS, attention_pool, max_pool, mean_pool
from srupp.models.config import SRUppConfig
from srupp.models.registry import task_models

from models_on_device import across_shapes

TYPES = ["srupp", "sru", "lstm", "gru", "transformer"]
# what each type needs beyond the shared fields, at d = 16
EXTRA = {"srupp": {"proj_size": 8, "num_heads": 2}, "sru": {}, "lstm": {}, "gru": {},
         "transformer": {"num_heads": 2, "ffn_mult": 2}}
V = 30


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes (tests/conftest.py)


def tiny(kind, device=None, **kw):
    """A tiny classifier of ``kind`` (d = 16, 2 layers, vocab 30, 3 labels), in eval mode,
    built on the CPU (the same weights whatever the device) and moved to ``device``."""
    torch.manual_seed(0)
    cfg = {"task": "classify", "type": kind, "num_labels": 3, "vocab_size": V, "d_model": 16,
           "num_layers": 2, **EXTRA[kind], **kw}
    return build_model(cfg).eval().to(device)


def ragged_batch(device=None):
    """4 rows of 7 with padding at the end, at the start, in the middle, and none."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (4, 7), generator=g)
    pad = torch.zeros(4, 7, dtype=torch.bool)
    pad[0, 4:] = True
    pad[1, :3] = True
    pad[2, [1, 2, 5]] = True
    tokens[pad] = 999  # ids under padding are never read
    return tokens.to(device), pad.to(device)


# --------------------------------------------------------------------------- registry, saving

def test_each_type_is_registered_under_classify():
    registered = task_models("classify")
    assert list(registered) == TYPES
    assert all(head is SequenceClassifier for _, head in registered.values())
    assert registered["srupp"][0] is SRUppClassifierConfig
    model = tiny("srupp")
    assert type(model) is SequenceClassifier and type(model.config) is SRUppClassifierConfig
    d = model.config.to_dict()
    assert d["task"] == "classify" and d["type"] == "srupp" and d["pooling"] == "mean"
    assert config_from_dict(d) == model.config


@pytest.mark.parametrize("kind", TYPES)
def test_save_and_load_give_identical_logits(kind, tmp_path, device):
    model = tiny(kind, device, pooling="attention")
    with torch.no_grad():  # a query away from its zero start, so that it is saved for real
        model.pooling.query.normal_()
    tokens, pad = ragged_batch(device)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, device=device)
    assert type(loaded) is SequenceClassifier and loaded.config == model.config
    assert not loaded.training
    torch.testing.assert_close(loaded(tokens, mask_pad=pad).logits,
                               model(tokens, mask_pad=pad).logits, rtol=0, atol=0)
    assert SequenceClassifier.from_pretrained(tmp_path).config == model.config


def test_from_pretrained_of_another_task_names_the_saved_task(tmp_path):
    tiny("lstm").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a classify model, which CausalLM cannot load"):
        CausalLM.from_pretrained(tmp_path)


# --------------------------------------------------------------------------- padding

def assert_padded_rows_match_alone(model, device):
    """Each row of a ragged, padded batch gets the logits it gets run alone."""
    tokens, pad = ragged_batch(device)
    with torch.no_grad():
        batch = model(tokens, mask_pad=pad).logits                       # (4, 3)
        for b in range(4):
            alone = model(tokens[b][~pad[b]].unsqueeze(0)).logits        # (1, 3)
            torch.testing.assert_close(batch[b:b + 1], alone,
                                       **across_shapes(device, rtol=0, atol=1e-6))


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("kind", TYPES)
def test_a_padded_row_gets_the_logits_it_gets_alone(kind, pooling, device):
    model = tiny(kind, device, pooling=pooling)
    if pooling == "attention":
        with torch.no_grad():
            model.pooling.query.normal_()
    assert_padded_rows_match_alone(model, device)


@pytest.mark.parametrize("layout,attends", [
    ({}, [True, True]),
    ({"attention_last_n_layers": 1}, [False, True]),
    ({"attention_last_n_layers": 0}, [False, False]),
    ({"attention_every_n_layers": 2}, [False, True]),
])
def test_srupp_attends_in_the_layers_the_config_names_and_stays_exact_under_padding(
        layout, attends, device):
    model = tiny("srupp", device, **layout)
    assert [layer.use_attention for layer in model.encoder.rnn.layers] == attends
    assert config_from_dict(model.config.to_dict()) == model.config
    assert_padded_rows_match_alone(model, device)


# --------------------------------------------------------------------------- pooling

@pytest.mark.parametrize("junk", [1e30, -1e30, float("inf"), float("nan")])
def test_pooling_sees_only_real_positions(junk, device):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 5, 4, generator=g, dtype=torch.float64).to(device)
    query = torch.randn(4, generator=g, dtype=torch.float64).to(device)
    pad = torch.tensor([[0, 0, 0, 1, 1], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool,
                       device=device)
    dirty = h.masked_fill(pad.unsqueeze(-1), junk)
    for b in range(3):
        real = h[b][~pad[b]]                                             # (n, 4)
        w = torch.softmax(real @ query, dim=0)                           # (n,)
        want = {"mean": real.mean(0), "max": real.max(0).values, "attention": w @ real}
        got = {"mean": mean_pool(dirty, pad)[b], "max": max_pool(dirty, pad)[b],
               "attention": attention_pool(dirty, pad, query)[b]}
        for how in POOLINGS:
            torch.testing.assert_close(got[how], want[how], msg=how)
    # without a mask every position is real
    torch.testing.assert_close(mean_pool(h, None), h.mean(1))
    torch.testing.assert_close(max_pool(h, None), h.max(1).values)
    torch.testing.assert_close(attention_pool(h, None, query),
                               torch.einsum("bl,bld->bd", torch.softmax(h @ query, 1), h))


def test_attention_pooling_starts_as_mean_pooling(device):
    mean, attention = tiny("srupp", device), tiny("srupp", device, pooling="attention")
    tokens, pad = ragged_batch(device)
    torch.testing.assert_close(attention(tokens, mask_pad=pad).logits,
                               mean(tokens, mask_pad=pad).logits)


# --------------------------------------------------------------------------- gradients

def test_gradcheck_of_the_srupp_classifier_in_float64(device):
    torch.manual_seed(0)
    cfg = SRUppClassifierConfig(vocab_size=6, num_labels=2, d_model=4, num_layers=2,
                                dropout=0.0, proj_size=2, pooling="attention")
    model = SequenceClassifier(cfg, dtype=torch.float64).eval()
    with torch.no_grad():
        model.pooling.query.normal_()
        for layer in model.encoder.rnn.layers:  # α starts at 0, which would hide the attention
            layer.transform.alpha.fill_(0.5)
    model.to(device)
    tokens = torch.tensor([[1, 2, 3, 4], [5, 0, 2, 0]], device=device)
    pad = torch.tensor([[False] * 4, [False, False, True, False]], device=device)
    labels = torch.tensor([0, 1], device=device)
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in model.parameters())

    def loss_and_logits(*ps):
        out = functional_call(model, dict(zip(names, ps)), (tokens,),
                              {"mask_pad": pad, "labels": labels})
        return out.loss, out.logits

    assert torch.autograd.gradcheck(loss_and_logits, params, eps=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- learning

def toy_task(n, g):
    """Rows of 3 to 8 tokens; label 1 when token 3 occurs (half of the rows)."""
    L = 8
    tokens = torch.randint(4, V, (n, L), generator=g)  # ids 0-3 left out, then 3 put in
    lengths = torch.randint(3, L + 1, (n,), generator=g)
    pad = torch.arange(L).unsqueeze(0) >= lengths.unsqueeze(1)           # (n, L)
    labels = torch.arange(n) % 2
    where = (torch.rand(n, generator=g) * lengths).long()
    tokens[labels == 1, where[labels == 1]] = 3
    return tokens, pad, labels


@pytest.mark.parametrize("kind", TYPES)
def test_learns_whether_a_token_occurs(kind, device):
    g = torch.Generator().manual_seed(3)  # the data is drawn on the CPU, then moved
    model = tiny(kind, device, pooling="max", dropout=0.0).train()
    tokens, pad, labels = (t.to(device) for t in toy_task(512, g))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(60):
        i = torch.randint(0, 512, (32,), generator=g).to(device)
        loss = model(tokens[i], mask_pad=pad[i], labels=labels[i]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    tokens, pad, labels = (t.to(device) for t in toy_task(256, g))
    with torch.no_grad():
        accuracy = (model.eval()(tokens, mask_pad=pad).logits.argmax(1) == labels).float().mean()
    assert accuracy >= 0.95, f"{kind}: accuracy {accuracy:.3f}"


# --------------------------------------------------------------------------- errors

def token_ids(*shape, device, fill=0, dtype=torch.long):
    return torch.full(shape, fill, dtype=dtype, device=device)


# The tokens are on the model's device; masks and labels stay on the CPU, where a caller may
# keep them: the checks read them on the tokens' device.
@pytest.mark.parametrize("call,message", [
    (lambda m, d: m(token_ids(5, device=d)), r"tokens must be a \(B, L\) long tensor"),
    (lambda m, d: m(token_ids(2, 3, device=d, dtype=torch.float32)),
     r"tokens must be a \(B, L\) long tensor.*float32"),
    (lambda m, d: m(token_ids(2, 0, device=d)), "at least one token per row"),
    (lambda m, d: m(token_ids(2, 3, device=d, fill=V)), r"ids outside \[0, vocab_size=30\)"),
    (lambda m, d: m(token_ids(2, 3, device=d), mask_pad=torch.zeros(2, 4, dtype=torch.bool)),
     r"mask_pad must be a bool tensor of the tokens' shape \(B, L\) = \(2, 3\)"),
    (lambda m, d: m(token_ids(2, 3, device=d), mask_pad=torch.zeros(2, 3)),
     "mask_pad must be a bool tensor"),
    (lambda m, d: m(token_ids(2, 3, device=d),
                    mask_pad=torch.tensor([[False, True, True], [True, True, True]])),
     "row 1 of mask_pad is all padding"),
    (lambda m, d: m(token_ids(2, 3, device=d), labels=torch.tensor([0, 3])),
     r"labels must be class ids in \[0, num_labels=3\), got values from 0 to 3"),
    (lambda m, d: m(token_ids(2, 3, device=d), labels=torch.tensor([-1, 0])),
     r"labels must be class ids in \[0, num_labels=3\)"),
    (lambda m, d: m(token_ids(2, 3, device=d), labels=torch.tensor([[0, 1]])),
     r"labels must be a \(B,\) = \(2,\) long tensor"),
], ids=["1-d", "float-tokens", "empty", "id-too-big", "mask-shape", "float-mask", "all-padding",
        "label-too-big", "label-negative", "labels-2-d"])
def test_bad_inputs_are_value_errors(call, message, device):
    with pytest.raises(ValueError, match=message):
        call(tiny("srupp", device), device)


@pytest.mark.parametrize("fields,message", [
    ({"type": "srupp", "pooling": "sum"},
     "pooling must be 'mean', 'max' or 'attention', got 'sum'"),
    ({"type": "lstm", "num_labels": 1}, "num_labels must be >= 2"),
    ({"type": "sru", "d_model": 15}, "d_model must be even: the bidirectional encoder"),
    ({"type": "transformer", "d_model": 15, "num_heads": 4}, r"num_heads \(4\) must divide"),
    ({"type": "srupp", "proj_size": 6, "num_heads": 4}, r"num_heads \(4\) must divide"),
    ({"type": "srupp", "dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"type": "srupp", "attention_every_n_layers": 0}, "attention_every_n_layers must be >= 1"),
    ({"type": "srupp", "attention_every_n_layers": 2, "attention_last_n_layers": 1},
     "attention_last_n_layers, not both"),
    ({"type": "srupp", "attention_last_n_layers": 3},
     r"attention_last_n_layers must be -1 \(off\) or 0..num_layers \(2\), got 3"),
    ({"type": "lstm", "proj_size": 8}, "^proj_size applies to type=srupp, not lstm$"),
    ({"type": "rnn"}, "type must be one of srupp, sru, lstm, gru, transformer for task classify"),
])
def test_bad_configs_are_value_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict({"task": "classify", "vocab_size": V, "num_labels": 3, **fields})


def test_the_shared_config_and_a_wrong_config_are_type_errors():
    with pytest.raises(TypeError, match="build the config of a model type"):
        ClassifierConfig(vocab_size=V, num_labels=3)
    with pytest.raises(TypeError, match="SequenceClassifier takes a classify model config"):
        SequenceClassifier(SRUppConfig())
