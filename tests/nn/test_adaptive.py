"""Adaptive input and projected adaptive softmax: against nn.AdaptiveLogSoftmaxWithLoss, tying.

The tests that compute something take the ``device`` fixture (``pytest --device
cuda`` runs them on the GPU): modules are built and inputs drawn on the CPU (the
same values on every device), then moved. fp32 tolerance: ``rtol=1e-5,
atol=1e-6`` on CPU, as these tests always had; on CUDA tests/tolerances.py's fp32
figure (``atol=1e-5``: cuBLAS blocks ours and torch's products differently).
"""

import pytest
import torch
from torch import nn
from tolerances import tol

from srupp.nn import AdaptiveInput, ProjectedAdaptiveLogSoftmax
from srupp.nn.adaptive import check_cutoffs

TOL = dict(rtol=1e-5, atol=1e-6)
V, D, CUTOFFS = 50, 16, [10, 20, 35]


def fp32_tol(device):
    return TOL if device.type == "cpu" else tol(torch.float32)


def untied_pair(div_val=2, head_bias=True):
    """Ours and torch's, with equal weights, where they are mathematically the same.

    emb_dim == d_model leaves the head unprojected (as torch's), and tail
    cluster i has width D // div_val**i in both. Tail biases are zero (torch has none).
    """
    torch.manual_seed(0)
    ours = ProjectedAdaptiveLogSoftmax(V, D, cutoffs=CUTOFFS, div_val=div_val, emb_dim=D)
    ref = nn.AdaptiveLogSoftmaxWithLoss(D, V, CUTOFFS, div_value=float(div_val),
                                        head_bias=head_bias)
    s = CUTOFFS[0]
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
        for b in ours.out_biases[1:]:
            b.zero_()
        assert ours.projection(0) is None
        ref.head.weight.copy_(torch.cat([ours.out_embs[0], ours.cluster_weight]))
        if head_bias:
            ref.head.bias.copy_(torch.cat([ours.out_biases[0], ours.cluster_bias]))
        else:
            ours.out_biases[0].zero_()
            ours.cluster_bias.zero_()
        for i, tail in enumerate(ref.tail, start=1):
            p = ours.projection(i)  # None where the width is D: torch's is then the identity
            tail[0].weight.copy_(torch.eye(D) if p is None else p.t())
            tail[1].weight.copy_(ours.out_embs[i])
    assert ref.shortlist_size == s
    return ours, ref


@pytest.mark.parametrize("div_val,head_bias", [(2, True), (1, True), (2, False)])
def test_matches_torch_adaptive_log_softmax(div_val, head_bias, device):
    ours, ref = untied_pair(div_val, head_bias)
    ours, ref = ours.to(device), ref.to(device)
    h = torch.randn(40, D).to(device).requires_grad_()
    h2 = h.detach().clone().requires_grad_(True)
    t = torch.randint(0, V, (40,))
    t[:4] = torch.tensor([0, 15, 25, 49])  # every cluster
    t = t.to(device)
    torch.testing.assert_close(ours.log_prob(h), ref.log_prob(h2), **fp32_tol(device))

    mine = ours.loss(h, t).mean()
    theirs = ref(h2, t).loss
    torch.testing.assert_close(mine, theirs, **fp32_tol(device))
    mine.backward()
    theirs.backward()
    torch.testing.assert_close(h.grad, h2.grad, **fp32_tol(device))
    # and the gradients of the weights they share: torch's head is [our shortlist rows;
    # our cluster rows], its tail i is (our projection i)^T, then our cluster i's rows
    s = CUTOFFS[0]
    pairs = [(ours.out_embs[0].grad, ref.head.weight.grad[:s]),
             (ours.cluster_weight.grad, ref.head.weight.grad[s:])]
    if head_bias:
        pairs += [(ours.out_biases[0].grad, ref.head.bias.grad[:s]),
                  (ours.cluster_bias.grad, ref.head.bias.grad[s:])]
    for i, tail in enumerate(ref.tail, start=1):
        pairs.append((ours.out_embs[i].grad, tail[1].weight.grad))
        if ours.projection(i) is not None:
            pairs.append((ours.projection(i).grad.t(), tail[0].weight.grad))
    for a, b in pairs:
        torch.testing.assert_close(a, b, **fp32_tol(device))


def test_loss_is_minus_gathered_log_prob_and_rows_sum_to_one(device):
    torch.manual_seed(1)
    inp = AdaptiveInput(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=8)
    out = ProjectedAdaptiveLogSoftmax(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=8,
                                      tie_embeddings=inp, tie_projections=[False, True, True, True])
    with torch.no_grad():
        for b in out.out_biases:
            b.normal_()
    h = torch.randn(3, 7, D, dtype=torch.float64).to(device)
    out.double().to(device)
    lp = out.log_prob(h)
    assert lp.shape == (3, 7, V) and lp.dtype == torch.float64
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(3, 7, dtype=torch.float64).to(device))
    t = torch.randint(0, V, (3, 7))
    t[0, 0] = -100
    t = t.to(device)
    nll = out.loss(h, t)
    assert nll.shape == (3, 7) and nll[0, 0] == 0
    expected = -lp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expected[0, 0] = 0
    torch.testing.assert_close(nll, expected)


def test_loss_computes_only_needed_clusters(device):
    out = ProjectedAdaptiveLogSoftmax(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=D).to(device)
    h = torch.randn(5, D).to(device).requires_grad_()
    out.loss(h, torch.tensor([1, 2, 3, 12, 13]).to(device)).sum().backward()  # shortlist, cluster 1
    assert out.out_embs[1].grad is not None
    assert out.out_embs[2].grad is None and out.out_embs[3].grad is None


def test_tied_clusters_and_projections_are_the_input_parameters():
    inp = AdaptiveInput(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=8)
    out = ProjectedAdaptiveLogSoftmax(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=8,
                                      tie_embeddings=inp, tie_projections=True)
    for i in range(4):
        assert out.out_embs[i] is inp.emb_layers[i].weight
        assert out.projection(i) is inp.projection(i) is not None
    model = nn.ModuleDict({"inp": inp, "out": out})
    own = len(out.out_biases) + 2  # biases + cluster weight and bias
    assert len(list(model.parameters())) == len(list(inp.parameters())) + own

    untied_proj = ProjectedAdaptiveLogSoftmax(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=8,
                                              tie_embeddings=inp, tie_projections=False)
    for i in range(4):
        assert untied_proj.out_embs[i] is inp.emb_layers[i].weight
        assert untied_proj.projection(i) is not inp.projection(i)
        assert untied_proj.projection(i).shape == inp.projection(i).shape

    # a gradient through the output reaches the shared input embedding
    out.loss(torch.randn(4, D), torch.tensor([0, 11, 22, 40])).sum().backward()
    assert inp.emb_layers[3].weight.grad is not None


def test_adaptive_input_embeds_each_cluster(device):
    torch.manual_seed(0)
    inp = AdaptiveInput(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=8).to(device)
    assert inp.widths == [8, 4, 2, 1]
    ids = torch.tensor([[0, 9, 10, 19], [20, 34, 35, 49]]).to(device)
    x = inp(ids)
    assert x.shape == (2, 4, D)
    for b in range(2):
        for j in range(4):
            w = int(ids[b, j])
            i = sum(w >= c for c in CUTOFFS)
            lo = ([0] + CUTOFFS)[i]
            e = inp.emb_layers[i].weight[w - lo] @ inp.projection(i).t()
            torch.testing.assert_close(x[b, j], e)
    if device.type == "cpu":
        # (on CUDA an out-of-range embedding index is a device-side assert, which
        # leaves the CUDA context unusable, not an IndexError)
        with pytest.raises(IndexError):
            inp(torch.tensor([V]))
    # no projection where the cluster is d_model wide
    same = AdaptiveInput(V, D, cutoffs=CUTOFFS, div_val=1, emb_dim=D).to(device)
    assert len(same.emb_projs) == 0
    torch.testing.assert_close(same(torch.tensor([3]).to(device)), same.emb_layers[0].weight[3:4])


def test_init_gives_every_cluster_the_plain_embedding_scale():
    torch.manual_seed(0)
    d = 256
    inp = AdaptiveInput(4000, d, cutoffs=[1000, 2000, 3000], div_val=4, emb_dim=512)
    for lo in (0, 1000, 2000, 3000):
        var = inp(torch.arange(lo, lo + 1000)).var().item()
        assert 0.7 / d < var < 1.3 / d


@pytest.mark.parametrize("cutoffs,error,match", [
    ([], ValueError, "empty"), ([20, 10], ValueError, "increasing"),
    ([10, 10], ValueError, "increasing"), ([0, 10], ValueError, "positive"),
    ([10, 50], ValueError, "< the vocabulary size"),
    ([10, 60], ValueError, "< the vocabulary size"),
    ("10,20", TypeError, "list"), ([10.5], TypeError, "integers")])
def test_bad_cutoffs_are_plain_errors_in_the_api_terms(cutoffs, error, match):
    for cls in (AdaptiveInput, ProjectedAdaptiveLogSoftmax):
        with pytest.raises(error, match=match) as e:
            cls(V, D, cutoffs=cutoffs)
        assert type(e.value) is error  # a plain library error, not the CLI's
        msg = str(e.value)
        assert msg.startswith("cutoffs ") and "\n" not in msg and "--set" not in msg


def test_check_cutoffs_names_the_callers_key():
    with pytest.raises(ValueError, match=r"^adaptive_cutoffs is empty"):
        check_cutoffs([], V, where="adaptive_cutoffs")
    assert check_cutoffs((10, 20), V) == [10, 20]


def test_other_bad_settings():
    with pytest.raises(ValueError, match="emb_dim"):
        AdaptiveInput(V, D, cutoffs=CUTOFFS, div_val=4, emb_dim=16)  # 16 // 64 == 0
    with pytest.raises(ValueError, match="needs tie_embeddings"):
        ProjectedAdaptiveLogSoftmax(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=D,
                                    tie_projections=True)
    inp = AdaptiveInput(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=8)
    with pytest.raises(ValueError, match="must match"):
        ProjectedAdaptiveLogSoftmax(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=16,
                                    tie_embeddings=inp)
    out = ProjectedAdaptiveLogSoftmax(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=D)
    with pytest.raises(ValueError, match="targets"):
        out.loss(torch.randn(2, D), torch.tensor([1, V]))


def _gathered(inp, ids):
    """AdaptiveInput as it was written before: each cluster's rows gathered (nonzero),
    embedded, projected and put back; the masked form must give the same."""
    flat = ids.reshape(-1)
    weight = inp.emb_layers[0].weight
    out = torch.zeros(flat.shape[0], inp.d_model, device=weight.device, dtype=weight.dtype)
    cluster = torch.bucketize(flat, inp._cutoff_tensor.to(flat.device), right=True)
    for i, lo in enumerate(inp.bounds[:-1]):
        idx = (cluster == i).nonzero().squeeze(1)
        e = inp.emb_layers[i](flat.index_select(0, idx) - lo)
        if inp.projection(i) is not None:
            e = torch.nn.functional.linear(e, inp.projection(i))
        out = out.index_copy(0, idx, e.to(out.dtype))
    return out.view(*ids.shape, inp.d_model)


@pytest.mark.parametrize("ids", [[[0, 9, 10, 19], [20, 34, 35, 49]],  # every cluster
                                 [[3, 3, 12, 49], [0, 1, 2, 48]]],   # none in cluster 2
                         ids=["all-clusters", "one-missing"])
def test_adaptive_input_masks_as_the_gathered_form_computed(ids, device):
    """Every cluster embeds every id and a mask keeps its rows (no nonzero, which waits for
    the GPU): outputs and gradients are the gathered form's. A cluster with no id now gets a
    zero gradient (an nn.Embedding's absent rows get zeros too) where it got none."""
    torch.manual_seed(0)
    inp = AdaptiveInput(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=8).to(device)
    ids = torch.tensor(ids).to(device)
    g = torch.randn(2, 4, D).to(device)
    (inp(ids) * g).sum().backward()
    mine = {n: p.grad.clone() for n, p in inp.named_parameters()}
    inp.zero_grad(set_to_none=True)
    out = _gathered(inp, ids)
    torch.testing.assert_close(inp(ids), out, **fp32_tol(device))
    (out * g).sum().backward()
    for n, p in inp.named_parameters():
        theirs = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(mine[n], theirs, **fp32_tol(device), msg=n)


@pytest.mark.parametrize("bad", [V, V + 7, -1, -101])
def test_a_target_out_of_range_is_a_value_error_on_the_cpu(bad):
    """On the CPU at once; on CUDA the same check is a device-side assertion, which needs
    no wait for the GPU (a failure stops the process at its next synchronisation)."""
    out = ProjectedAdaptiveLogSoftmax(V, D, cutoffs=CUTOFFS, div_val=2, emb_dim=D)
    with pytest.raises(ValueError, match=rf"^targets must be in \[0, {V - 1}\] \(or -100 "
                                         rf"to ignore\)$"):
        out.loss(torch.randn(3, D), torch.tensor([1, bad, -100]))
    assert out.loss(torch.randn(3, D), torch.tensor([1, V - 1, -100]))[2] == 0
