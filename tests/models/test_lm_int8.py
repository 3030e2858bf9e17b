"""model.quantize("int8") on the language model: the same model in int8 weights, for
inference (srupp.nn.quant)."""

import copy

import pytest
import torch

from srupp.nn.quant import Int8Linear

from lm_helpers import tiny_srupp_lm

# int8 against fp32 logits: each weight moves by at most scale / 2 = max|w_row| / 254;
# through this tiny model's four layers the logits (of size ~1) move by about 1e-2.
INT8_TOL = dict(rtol=0.05, atol=0.05)
# the same int8 model through two paths (the few-rows kernel in step, dequantize + GEMM in
# a long forward): fp32 summation order only
PATH_TOL = dict(rtol=1e-4, atol=1e-4)


def make(**kw):
    return tiny_srupp_lm(**{"d_model": 16, "proj_size": 8, **kw})


def test_quantize_converts_backbone_and_output_and_keeps_embedding():
    m = make()
    n = m.num_parameters()
    assert m.quantize("int8") is m and m.quantized and not m.training
    assert isinstance(m.output, Int8Linear) and isinstance(m.embedding, torch.nn.Embedding)
    assert not any(isinstance(x, torch.nn.Linear) for x in m.modules())
    assert m.num_parameters() == n


@torch.no_grad()
@pytest.mark.parametrize("tied", [False, True])
def test_quantized_logits_stay_close_to_fp32(tied):
    m = make(tie_embeddings=tied)
    tokens = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = m(tokens).logits
    out = copy.deepcopy(m).quantize()(tokens).logits
    torch.testing.assert_close(out, ref, **INT8_TOL)
    assert float((out - ref).abs().max()) > 0  # it did quantize


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_step_equals_forward_token_by_token(dtype):
    m = make().quantize().to(dtype)
    tokens = torch.randint(0, 11, (2, 40), generator=torch.Generator().manual_seed(2))
    full = m(tokens).logits                                        # (B, L, V)
    state = m.initial_state(2)
    for t in range(tokens.shape[1]):
        logits, state = m.step(tokens[:, t], state)
        tol = PATH_TOL if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(logits, full[:, t], **tol)


# w8a8 rounds every layer's input to int8 per row: a last-bit difference between the two
# paths upstream can move an activation across a rounding boundary, which moves an
# output by one step of that row's scale times a weight (about 1% of the row's largest
# term), so the paths agree to that, not to fp32 summation order
W8A8_PATH_TOL = dict(rtol=3e-2, atol=3e-2)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_step_equals_forward_token_by_token(dtype):
    m = make().quantize("w8a8").to(dtype)
    tokens = torch.randint(0, 11, (2, 40), generator=torch.Generator().manual_seed(2))
    full = m(tokens).logits                                        # (B, L, V)
    state = m.initial_state(2)
    for t in range(tokens.shape[1]):
        logits, state = m.step(tokens[:, t], state)
        torch.testing.assert_close(logits, full[:, t], **W8A8_PATH_TOL)


@torch.no_grad()
def test_w8a8_logits_stay_close_to_fp32():
    m = make()
    tokens = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = m(tokens).logits
    int8 = copy.deepcopy(m).quantize("int8")(tokens).logits
    w8a8 = copy.deepcopy(m).quantize("w8a8")(tokens).logits
    torch.testing.assert_close(w8a8, ref, **INT8_TOL)
    assert not torch.equal(w8a8, int8)  # the activations were rounded too


@torch.no_grad()
def test_quantized_model_generates():
    m = make().quantize()
    out = m.generate([[1, 2, 3]], 8, temperature=0)[0]
    seq = [1, 2, 3]
    for _ in range(8):  # greedy by recomputing the whole sequence
        seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out == seq[3:]


def test_quantize_errors_are_clear(tmp_path):
    m = make()
    with pytest.raises(ValueError, match=r"unknown quantization 'int4'.*'int8'"):
        m.quantize("int4")
    m.quantize()
    with pytest.raises(ValueError, match="already quantized"):
        m.quantize()
    with pytest.raises(ValueError, match="inference only"):
        m.train()
    with pytest.raises(ValueError, match="quantize it after loading"):
        m.save_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match="no_grad"):
        with torch.enable_grad():
            m.embedding.weight.requires_grad_(True)
            m(torch.tensor([[1, 2]]))


@torch.no_grad()
@pytest.mark.parametrize("design", ["memory", "sublayer"])
def test_translation_and_classification_heads_quantize_too(design):
    from srupp.models import EncoderDecoder, SequenceClassifier, SRUppSeq2SeqConfig
    from srupp.models.config import config_from_dict
    from srupp.models.decoding import greedy_decode

    torch.manual_seed(0)
    m = EncoderDecoder(SRUppSeq2SeqConfig(vocab_size=13, d_model=16, encoder_layers=2,
                                          decoder_layers=2, dropout=0.0,
                                          cross_attention=design)).eval()
    src = torch.randint(4, 13, (2, 6), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(4, 13, (2, 5), generator=torch.Generator().manual_seed(4))
    ref = m(src, tgt).logits
    q = copy.deepcopy(m).quantize()
    torch.testing.assert_close(q(src, tgt).logits, ref, **INT8_TOL)
    # decoding steps through the caches the quantized layers fill
    assert len(greedy_decode(q, src, max_len_b=4)) == 2

    c = SequenceClassifier(config_from_dict(dict(task="classify", type="srupp", vocab_size=13,
                                                 d_model=16, num_layers=2, num_labels=3,
                                                 dropout=0.0))).eval()
    tokens = torch.randint(0, 13, (2, 7))
    ref = c(tokens).logits
    torch.testing.assert_close(copy.deepcopy(c).quantize()(tokens).logits, ref, **INT8_TOL)
