"""The SRU++ encoder–decoder: config, registry, saving, gradients, padding, decoding state."""

import pytest
import torch
from torch.func import functional_call

from srupp.models import (EncoderDecoder, EncoderOutput, Seq2SeqConfig, SRUppSeq2SeqConfig,
                          build_model, config_from_dict, load_model)
from srupp.models.backbones import CrossAttentionState
from srupp.models.decoding import beam_search
from srupp.ops.layer_step import use_step_backend
from srupp.nn import SRUpp, SRUppState

from models_on_device import across_shapes

DESIGNS = ["memory", "sublayer"]
V, D = 20, 16


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes (tests/conftest.py)


def make(design="memory", dtype=None, device=None, **kw):
    """Built on the CPU (the same weights whatever the device), moved to ``device``."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2, dropout=0.0,
               cross_attention=design)
    cfg.update(kw)
    m = EncoderDecoder(SRUppSeq2SeqConfig(**cfg), dtype=dtype).eval()
    with torch.no_grad():  # give attention a say (α starts at 0) and the recurrence some memory
        for module in m.modules():
            if hasattr(module, "alpha"):
                module.alpha.fill_(0.8)
    return m.to(device)


def batch(B=3, S=6, T=5, seed=1, device=None):
    """Sources with padding at the end of rows 1 and 2 on, and decoder inputs (made on the
    CPU, then moved to ``device``)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(2, V, (B, S), generator=g)
    tgt = torch.randint(2, V, (B, T), generator=g)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, 3:] = True
    pad[2:, S - 1:] = True
    return src.to(device), pad.to(device), tgt.to(device)


# ------------------------------------------------------------------ config and registry

@pytest.mark.parametrize("kw,message", [
    (dict(d_model=15), "d_model must be even"),
    (dict(cross_attention="both"), "cross_attention must be 'memory' or 'sublayer'"),
    (dict(proj_size=6, num_heads=4), r"num_heads \(4\) must divide proj_size \(6\)"),
    (dict(proj_size=0), "proj_size must be >= 1 or None"),
    (dict(attn_dropout=1.0), r"attn_dropout must be in \[0, 1\)"),
    (dict(eos_id=20, vocab_size=20), "eos_id must be a token id below vocab_size"),
])
def test_config_errors_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        SRUppSeq2SeqConfig(**kw)


def test_config_defaults_and_base_config():
    c = SRUppSeq2SeqConfig()
    assert (c.d_model, c.resolved_proj_size, c.num_heads, c.highway_bias) == (256, 64, 1, -2.0)
    assert SRUppSeq2SeqConfig(d_model=32).resolved_proj_size == 8
    assert SRUppSeq2SeqConfig(d_model=32, proj_size=12).resolved_proj_size == 12
    with pytest.raises(TypeError, match="build the config of a model type"):
        Seq2SeqConfig()


def test_registry_builds_seq2seq():
    m = build_model({"task": "translate", "type": "srupp", "vocab_size": V, "d_model": D,
                     "cross_attention": "sublayer"})
    assert type(m) is EncoderDecoder and m.config.cross_attention == "sublayer"
    assert m.config.to_dict()["task"] == "translate"
    with pytest.raises(ValueError, match="unknown config key 'num_layers'"):
        config_from_dict({"task": "translate", "type": "srupp", "num_layers": 2})
    with pytest.raises(TypeError, match="EncoderDecoder takes a translate model config"):
        EncoderDecoder(object())


@pytest.mark.parametrize("design", DESIGNS)
def test_save_and_load_give_identical_outputs(design, tmp_path, device):
    m = make(design, device=device, tie_embeddings=False)
    src, pad, tgt = batch(device=device)
    m.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, device=device)
    assert type(loaded) is EncoderDecoder and loaded.config == m.config and not loaded.training
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, tgt, src_pad=pad).logits,
                                   m(src, tgt, src_pad=pad).logits, rtol=0, atol=0)


# ------------------------------------------------------------------ gradients

@pytest.mark.parametrize("design", DESIGNS)
def test_gradcheck_float64(design, device):
    m = make(design, dtype=torch.float64, device=device, d_model=8, vocab_size=7,
             encoder_layers=1)
    src = torch.tensor([[2, 3, 4], [5, 6, 0]], device=device)
    tgt = torch.tensor([[1, 4, 2], [1, 3, 3]], device=device)
    pad = torch.tensor([[False, False, False], [False, False, True]], device=device)
    names = ["embedding.weight", "encoder.rnn.layers.0.transform.alpha",
             "decoder.rnn.layers.1.transform.alpha" if design == "memory"
             else "decoder.cross.1.key_value.weight"]
    params = dict(m.named_parameters())
    inputs = tuple(params[n].detach().clone().requires_grad_() for n in names)

    def logits(*ps):
        return functional_call(m, dict(zip(names, ps)), (src, tgt), {"src_pad": pad}).logits

    assert torch.autograd.gradcheck(logits, inputs, eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------ padding and decoding

def test_encoder_output_under_padding_equals_each_sentence_alone(device):
    m = make(device=device)
    src, pad, _ = batch(S=7, device=device)
    with torch.no_grad():
        enc = m.encode(src, pad)
        for b in range(src.shape[0]):
            n = int((~pad[b]).sum())
            alone = m.encode(src[b:b + 1, :n]).states[0]                   # (n, d)
            torch.testing.assert_close(enc.states[b, :n], alone,
                                       **across_shapes(device, rtol=0, atol=1e-6))


@pytest.mark.parametrize("design", DESIGNS)
def test_padded_batch_scores_each_sentence_as_alone(design, device):
    """The decoder never reads padded source positions (whose encoder output is 0 but
    whose keys would still take softmax weight)."""
    m = make(design, device=device)
    src, pad, tgt = batch(device=device)
    with torch.no_grad():
        logits = m(src, tgt, src_pad=pad).logits                          # (B, T, V)
        for b in range(src.shape[0]):
            n = int((~pad[b]).sum())
            alone = m(src[b:b + 1, :n], tgt[b:b + 1]).logits[0]
            torch.testing.assert_close(logits[b], alone,
                                       **across_shapes(device, rtol=0, atol=1e-5))


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("grad", [False, True])
def test_step_by_step_equals_teacher_forcing(design, grad, device):
    m = make(design, device=device)
    src, pad, tgt = batch(device=device)
    with torch.set_grad_enabled(grad):  # no_grad: the K/V-cached path; grad: recomputed
        enc = m.encode(src, pad)
        forced = m.decode(tgt, enc)                                      # (B, T, d)
        state = m.init_decoder(enc)
        steps = []
        for t in range(tgt.shape[1]):
            h, state = m.decode_step(tgt[:, t], state)
            steps.append(h)
    torch.testing.assert_close(torch.stack(steps, 1), forced, rtol=0, atol=1e-5)
    # and the source matters
    with torch.no_grad():
        other = m.decode(tgt, m.encode(src.flip(1), pad.flip(1)))
    assert (other - forced).abs().max() > 1e-3


def test_memory_design_adds_no_parameters():
    m = make("memory")
    c = m.config
    plain = SRUpp(D, D, c.resolved_proj_size, c.decoder_layers, causal=True)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert count(m.decoder) == count(plain)
    assert m.num_parameters() == count(m.embedding) + V + count(m.encoder) + count(plain)
    assert make("sublayer").num_parameters() > m.num_parameters()


@pytest.mark.parametrize("design", DESIGNS)
def test_reorder_equals_running_the_selected_rows(design, device):
    m = make(design, device=device)
    src, pad, tgt = batch(device=device)
    index = torch.tensor([2, 0, 2])  # on the CPU: reorder takes an index on any device
    with torch.no_grad():
        state = m.init_decoder(m.encode(src, pad))
        h, state = m.decode_step(tgt[:, 0], state)
        state = m.reorder(state, index)
        got, _ = m.decode_step(tgt[index, 1], state)
        alone = m.init_decoder(m.encode(src[index], pad[index]))
        _, alone = m.decode_step(tgt[index, 0], alone)
        want, _ = m.decode_step(tgt[index, 1], alone)
    torch.testing.assert_close(got, want, **across_shapes(device, rtol=0, atol=1e-6))
    kind = SRUppState if design == "memory" else CrossAttentionState
    assert isinstance(state, kind)


@pytest.mark.parametrize("design", DESIGNS)
def test_training_lowers_the_loss_on_reversal(design, device):
    """Reversing 4 tokens of 10: a decoder that ignores the source can do no better than
    4·ln(10)/5 ≈ 1.84 nats per token (position known, EOS free)."""
    m = make(design, device=device, vocab_size=12).train()
    opt = torch.optim.Adam(m.parameters(), lr=3e-2)
    g = torch.Generator().manual_seed(0)
    eos = torch.ones(32, 1, dtype=torch.long, device=device)
    losses = []
    for _ in range(80):
        seq = torch.randint(2, 12, (32, 4), generator=g).to(device)
        rev = seq.flip(1)
        out = m(torch.cat([seq, eos], 1), torch.cat([eos, rev], 1),
                targets=torch.cat([rev, eos], 1), label_smoothing=0.1)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.nll.item())
    assert sum(losses[:5]) / 5 > 2.3 and sum(losses[-5:]) / 5 < 1.65


@pytest.mark.parametrize("design", DESIGNS)
def test_source_keys_and_values_are_computed_once_per_sentence(design, device):
    """Beam search reads the encoder through K/V made in init_decoder: every later call of
    the projections that make them sees one new position per row, never the source."""
    m = make(design, device=device)
    src, pad, _ = batch(B=2, S=6, device=device)
    calls = []
    if design == "memory":
        watched = [layer.transform.linear1 for layer in m.decoder.rnn.layers]
    else:
        watched = [cross.key_value for cross in m.decoder.cross]
    hooks = [lin.register_forward_hook(lambda mod, args, out: calls.append(tuple(args[0].shape)))
             for lin in watched]
    try:
        # the modules' step: the fused one runs a layer without calling its modules (it
        # reads K/V from the same cache; tests/nn/test_srupp_fused_step.py)
        with use_step_backend("modules"):
            beam_search(m, src, pad, beam=3, max_len_b=3)
    finally:
        for h in hooks:
            h.remove()
    source_calls = [s for s in calls if s[1] != 1]
    assert source_calls == [(2, 6, D)] * len(watched)      # the 2 sentences, once per layer
    if design == "memory":  # then each step projects only its new token, on 2 · 3 beams at most
        steps = [s for s in calls if s[1] == 1]
        assert steps and all(s[0] <= 6 and s[2] == D for s in steps)
    else:                   # the sub-layers' K/V are never made again
        assert calls == source_calls


def test_decode_steps_grow_memory_and_cache_and_keep_the_encoder_output(device):
    m = make("memory", device=device)
    src, pad, tgt = batch(device=device)
    with torch.no_grad():
        enc = m.encode(src, pad)
        before = enc.states.clone()
        state = m.init_decoder(enc)
        for t in range(3):
            _, state = m.decode_step(tgt[:, t], state)
    assert torch.equal(enc.states, before)
    # memory and K/V cache: the source, then one row per step
    assert state.memory_length == src.shape[1] + 3
    assert [kv.kv.shape[:2] for kv in state.kv_cache] == [(3, src.shape[1] + 3)] * 2
    # rows of the encoder output, by an index on the CPU (a list, too) whatever the device
    for index in (torch.tensor([2, 0]), [2, 0]):
        picked = EncoderOutput(enc.states, pad).index_select(index)
        assert isinstance(picked, EncoderOutput) and picked.states.device == enc.states.device
        assert torch.equal(picked.states, enc.states[[2, 0]])
        assert torch.equal(picked.pad, pad[[2, 0]])


@pytest.mark.parametrize("index,group,copies", [
    ([0, 0, 1, 1, 2, 2], 2, False),     # beams of every sentence: the source is not copied
    ([2, 2, 2, 0, 0, 0], 3, True),      # beams of some sentences, reordered
    ([2, 0, 2], 1, True),               # rows that are no runs: one source entry each
    ([0, 1, 2], 1, False),              # the same rows
])
def test_cross_attention_state_groups_beams_over_one_source(index, group, copies, device):
    m = make("sublayer", device=device)
    src, pad, tgt = batch(device=device)
    index = torch.tensor(index, device=device)  # as beam search makes it
    with torch.no_grad():
        state = m.init_decoder(m.encode(src, pad))
        _, state = m.decode_step(tgt[:, 0], state)
        picked = m.reorder(state, index)
        assert picked.group == group and picked.keys[0].shape[0] == len(index) // group
        assert (picked.keys[0].data_ptr() != state.keys[0].data_ptr()) == copies
        # the state's own index_select takes an index on any device (a CPU one here)
        by_cpu_index = state.index_select(index.cpu())
        assert by_cpu_index.group == group
        assert all(torch.equal(a, b) for a, b in zip(by_cpu_index.keys, picked.keys))
        got, after = m.decode_step(tgt[index, 1], picked)
        # the same rows without grouping: every row its own copy of the source
        flat = CrossAttentionState(picked.layers, [k.index_select(0, index) for k in state.keys],
                                   [v.index_select(0, index) for v in state.values],
                                   None if state.mask is None else state.mask[index])
        want, _ = m.decode_step(tgt[index, 1], flat)
        # and the grouping survives a second reorder within the groups
        again = m.reorder(after, torch.arange(len(index)).flip(0) if group == 1
                          else torch.arange(len(index)))
    torch.testing.assert_close(got, want, **across_shapes(device, rtol=0, atol=1e-6))
    assert again.group == group
