"""The language model with adaptive input and softmax: loss, log-probs, state, generation, saving."""

import pytest
import torch

from srupp.models import CausalLM, SRUppConfig
from srupp.train import evaluate

from lm_helpers import greedy_by_recomputing
from models_on_device import across_shapes, generators

TOL = dict(rtol=1e-5, atol=1e-6)
V = 40


def make(device=None, **kw):
    """The tiny model, built on the CPU (the same weights whatever the device), moved to device."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, d_model=8, proj_size=4, num_layers=2, dropout=0.0, mem_len=64,
               adaptive_cutoffs=[10, 20], div_val=2, emb_dim=8, tie_embeddings=True)
    cfg.update(kw)
    m = CausalLM(SRUppConfig(**cfg)).eval()
    with torch.no_grad():
        for layer in m.backbone.rnn.layers:
            layer.transform.alpha.fill_(0.7)
        for b in m.output.out_biases:
            b.normal_()
    return m.to(device)


def test_loss_is_mean_nll_of_log_probs_and_logits_are_log_probs(device):
    m = make(device)
    t = torch.randint(0, V, (3, 6)).to(device)
    y = torch.randint(0, V, (3, 6)).to(device)
    y[0, 0] = -100
    lp = m(t).logits
    assert lp.shape == (3, 6, V)
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(3, 6, device=device), **TOL)
    out = m(t, targets=y)
    assert out.logits is None
    keep = y != -100
    expected = -lp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep].mean()
    torch.testing.assert_close(out.loss, expected, **TOL)
    out.loss.backward()
    assert m.embedding.emb_layers[2].weight.grad is not None


def test_tying_counts_shared_parameters_once():
    tied = make()
    untied = make(tie_embeddings=False)
    proj_untied = make(tie_projections=False)
    for i in range(3):
        assert tied.output.out_embs[i] is tied.embedding.emb_layers[i].weight
    assert tied.output.projection(1) is tied.embedding.projection(1)
    assert tied.output.projection(0) is None  # emb_dim == d_model: no head projection
    emb = sum(e.weight.numel() for e in tied.embedding.emb_layers)
    projs = sum(p.numel() for p in tied.embedding.emb_projs.values())
    assert untied.num_parameters() == tied.num_parameters() + emb + projs
    assert proj_untied.num_parameters() == tied.num_parameters() + projs


def test_segments_with_state_match_one_pass(device):
    m = make(device)
    t = torch.randint(0, V, (2, 12)).to(device)
    full = m(t).logits
    a = m(t[:, :5])
    b = m(t[:, 5:], a.state.detach())
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full,
                               **across_shapes(device, **TOL))


def test_greedy_generation_matches_recomputation(device):
    m = make(device)
    prompt = [1, 25, 12, 7]
    got = m.generate([prompt], 6, temperature=0)[0]
    assert got == greedy_by_recomputing(m, prompt, 6)
    for g in generators(device, 0):
        sampled = m.generate([prompt], 5, temperature=0.8, top_k=5, generator=g)[0]
        assert len(sampled) == 5 and all(0 <= s < V for s in sampled)


def test_evaluate_uses_the_targets_path_and_agrees(device):
    m = make(device)
    ids = torch.randint(0, V, (200,))
    res = evaluate(m, ids, batch_size=2, unroll=16)

    class LogitsOnly(torch.nn.Module):  # no .adaptive: evaluate's cross-entropy path
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def initial_state(self, *a, **k):
            return self.lm.initial_state(*a, **k)

        def forward(self, x, state=None):
            return self.lm(x, state)

    old = evaluate(LogitsOnly(m), ids, batch_size=2, unroll=16)
    assert res["tokens"] == old["tokens"]
    assert res["loss"] == pytest.approx(old["loss"], rel=1e-5)


def test_save_and_load_keeps_ties(tmp_path, device):
    m = make(device)
    m.save_pretrained(tmp_path / "m")
    back = CausalLM.from_pretrained(tmp_path / "m", device=device)
    assert back.config.adaptive_cutoffs == [10, 20]
    assert back.output.out_embs[1] is back.embedding.emb_layers[1].weight
    t = torch.randint(0, V, (2, 7)).to(device)
    torch.testing.assert_close(back(t).logits, m(t).logits)


@pytest.mark.parametrize("kw,match", [
    (dict(adaptive_cutoffs=[10, 50]), "vocabulary size"),
    (dict(adaptive_cutoffs=[20, 10]), "increasing"),
    (dict(adaptive_cutoffs=[]), "empty"),
    (dict(adaptive_cutoffs=None, emb_dim=8), "adaptive_cutoffs"),
    (dict(adaptive_cutoffs=None, div_val=2), "adaptive_cutoffs"),
    (dict(emb_dim=2, div_val=4), "emb_dim"),
    (dict(div_val=0), "div_val"),
])
def test_bad_adaptive_config_is_a_value_error(kw, match):
    cfg = dict(vocab_size=V, d_model=8, proj_size=4, adaptive_cutoffs=[10, 20], div_val=2)
    cfg.update(kw)
    with pytest.raises(ValueError, match=match) as e:
        SRUppConfig(**cfg)
    assert "\n" not in str(e.value)
