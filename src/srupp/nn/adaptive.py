"""Adaptive input embeddings and a projected adaptive softmax that can share them.

Large word vocabularies (WikiText-103: 267,735 words; Billion Word: ~793k)
make a plain d × V embedding and output layer the largest part of the model.
Both modules here split the vocabulary, sorted by frequency, into clusters
at ``cutoffs``: cluster i covers ids [c_{i-1}, c_i) (c_{-1} = 0, the last
cluster ends at V). Cluster i has an embedding of width
``n_i = emb_dim // div_val**i`` and a bias-free projection between that width
and ``d_model``, so rare words get narrow embeddings.

* :class:`AdaptiveInput` maps ids to ``d_model`` vectors: embed in the
  cluster's width, then project up to ``d_model``.
* :class:`ProjectedAdaptiveLogSoftmax` scores the next word. The *head*
  covers the shortlist (cluster 0) plus one logit per tail cluster; a word in
  tail cluster i has log p = log p_head(cluster i) + log p_i(word | cluster i).
  Every cluster projects the hidden state from ``d_model`` down to its width
  and takes dot products with its output embeddings, plus one bias per output.
  The output embeddings (and, optionally, the projections) can be the very
  ``Parameter`` objects of an :class:`AdaptiveInput`, as in the SRU++ paper's
  WikiText-103 and Billion Word models.

Design choices:

* **Skipped projections.** A cluster whose width equals ``d_model`` gets no
  projection: a square linear map in front of an embedding adds parameters
  but no expressiveness (it can be folded into the embedding). This covers
  ``div_val == 1 and emb_dim == d_model`` (no projection anywhere) and makes
  the head of ``emb_dim == d_model`` identical in form to
  ``torch.nn.AdaptiveLogSoftmaxWithLoss``'s.
* **Projection layout.** Every projection is stored as a (d_model, n_i)
  ``Parameter``: the input side computes ``e @ Pᵀ`` (n_i → d_model), the output
  side ``h @ P`` (d_model → n_i). One layout lets the two sides share it.
* **No √d scaling, variance-matched init.** Transformer-XL multiplies its
  adaptive embeddings by √d_proj; srupp does not. SRU++ has no positional
  encoding for an embedding scale to be balanced against, and the plain
  embedding of :class:`~srupp.models.CausalLM` is initialised
  U(±√(3/d)), i.e. variance 1/d per element. Here embeddings are
  N(0, 1/n_i) and projections N(0, 1/d_model), so every cluster's input
  vector also has variance 1/d_model per element (and a cluster without a
  projection, n_i = d_model, gets N(0, 1/d_model) directly): the SRU++ stack
  sees the same input scale with or without adaptive inputs, and no cluster
  starts louder than another. On the output side the same init gives logits
  with about the hidden state's variance, whatever the cluster width. Output
  biases and the head's cluster biases start at 0.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["AdaptiveInput", "ProjectedAdaptiveLogSoftmax", "check_cutoffs"]


def check_cutoffs(cutoffs, vocab_size: int, *, where: str = "cutoffs") -> List[int]:
    """Validate adaptive cut-offs and return them as a list of ints.

    They must be a non-empty, strictly increasing list of ids in (0, vocab_size).
    Raises ``TypeError`` (not a list of ints) or ``ValueError`` otherwise, in one
    line naming ``where`` (a caller such as a config may name its own key).
    """
    example = "e.g. [20000, 40000, 200000] for a 267,735-word vocabulary"
    if isinstance(cutoffs, (str, bytes)) or not isinstance(cutoffs, Sequence):
        raise TypeError(f"{where} must be a list of increasing ids, {example}; got {cutoffs!r}")
    if len(cutoffs) == 0:
        raise ValueError(f"{where} is empty: give at least one cut-off, {example}, "
                         f"or use a plain softmax")
    if any(isinstance(c, bool) or not isinstance(c, int) for c in cutoffs):
        raise TypeError(f"{where} must hold integers, {example}; got {list(cutoffs)!r}")
    out = [int(c) for c in cutoffs]
    if any(b <= a for a, b in zip(out, out[1:])) or out[0] <= 0:
        raise ValueError(f"{where} must be positive and strictly increasing, {example}; "
                         f"got {out}")
    if out[-1] >= vocab_size:
        raise ValueError(f"{where} must all be < the vocabulary size ({vocab_size}); got {out}: "
                         f"drop the cut-offs >= {vocab_size} or use a larger vocab_size")
    return out


class _Clusters(nn.Module):
    """The cluster layout both adaptive modules share (see the module docstring)."""

    def _init_clusters(self, vocab_size: int, d_model: int, cutoffs: Sequence[int],
                       div_val: int, emb_dim: int, device) -> None:
        where = type(self).__name__
        self.cutoffs = check_cutoffs(cutoffs, vocab_size)
        self.vocab_size, self.d_model = vocab_size, d_model
        self.div_val, self.emb_dim = div_val, emb_dim
        self.bounds = [0] + self.cutoffs + [vocab_size]
        n_clusters = len(self.bounds) - 1
        if div_val < 1:
            raise ValueError(f"{where}: div_val must be >= 1, got {div_val}")
        if emb_dim < 1:
            raise ValueError(f"{where}: emb_dim must be >= 1, got {emb_dim}")
        self.widths = [emb_dim // div_val ** i for i in range(n_clusters)]
        if self.widths[-1] < 1:
            raise ValueError(f"{where}: emb_dim {emb_dim} // div_val**{n_clusters - 1} is 0; "
                             f"raise emb_dim, lower div_val or use fewer cut-offs")
        self.register_buffer("_cutoff_tensor", torch.tensor(self.cutoffs, device=device),
                             persistent=False)

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, d_model={self.d_model}, cutoffs={self.cutoffs}, "
                f"div_val={self.div_val}, emb_dim={self.emb_dim}")


def _check_on_device(ok: Tensor, message: str) -> None:
    """ValueError(message) unless ``ok`` (a one-element bool tensor), never waiting for a GPU.

    ``bool(ok)`` would copy it to the host, which waits for everything queued on
    the device before. On the CPU the check is immediate; on CUDA it is a
    device-side assertion that needs no wait: a failure stops the process at
    its next synchronisation, as an out-of-range index does on CUDA.
    """
    try:
        torch._assert_async(ok, message)
    except RuntimeError:
        raise ValueError(message) from None


def _at_least_fp32(x: Tensor) -> Tensor:
    """Softmax statistics in fp32 under bf16/fp16 autocast; fp64 stays fp64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class AdaptiveInput(_Clusters):
    """Adaptive input embedding: ids (...) → vectors (..., d_model).

    Args:
        vocab_size: V.
        d_model: output width.
        cutoffs: increasing cluster boundaries, all < V (see the module docstring).
        div_val: cluster i has width ``emb_dim // div_val**i``.
        emb_dim: n_e, the width of cluster 0.

    Attributes:
        emb_layers: one ``nn.Embedding`` per cluster (sizes c_i - c_{i-1}).
        emb_projs: ``ParameterDict`` {str(i): (d_model, n_i)} for clusters
            whose width differs from ``d_model``.
    """

    def __init__(self, vocab_size: int, d_model: int, *, cutoffs: Sequence[int],
                 div_val: int = 4, emb_dim: int = 1024, device=None, dtype=None):
        super().__init__()
        self._init_clusters(vocab_size, d_model, cutoffs, div_val, emb_dim, device)
        bounds = self.bounds
        factory = {"device": device, "dtype": dtype}
        self.emb_layers = nn.ModuleList(
            nn.Embedding(hi - lo, w, **factory)
            for lo, hi, w in zip(bounds, bounds[1:], self.widths))
        self.emb_projs = nn.ParameterDict({
            str(i): nn.Parameter(torch.empty(d_model, w, **factory))
            for i, w in enumerate(self.widths) if w != d_model})
        self.reset_parameters()

    @property
    def n_clusters(self) -> int:
        return len(self.widths)

    def projection(self, i: int) -> Optional[nn.Parameter]:
        """Cluster i's (d_model, n_i) projection, or None when n_i == d_model."""
        return self.emb_projs[str(i)] if str(i) in self.emb_projs else None

    def reset_parameters(self) -> None:
        """Embeddings N(0, 1/n_i), projections N(0, 1/d_model): variance 1/d_model out."""
        for emb, w in zip(self.emb_layers, self.widths):
            nn.init.normal_(emb.weight, 0.0, w ** -0.5)
        for p in self.emb_projs.values():
            nn.init.normal_(p, 0.0, self.d_model ** -0.5)

    def forward(self, ids: Tensor) -> Tensor:
        """ids (...) → (..., d_model), in the embeddings' dtype.

        Every cluster embeds and projects every id, and a mask keeps its own
        rows: the rows of a cluster are not gathered, since their number
        (``nonzero``) would be read back from the device, which makes the
        host wait for the GPU at the start of every training step. The
        projections of the other clusters' rows are the cost: N·d·Σn_i
        multiply-adds more, about 1% of a WikiText-103 step's FLOPs.
        """
        flat = ids.reshape(-1)                                            # (N,)
        dtype = self.emb_layers[0].weight.dtype
        # the first and last clusters also take out-of-range ids, so that
        # nn.Embedding reports them (other rows look up a cluster's row 0)
        cluster = torch.bucketize(flat, self._cutoff_tensor.to(flat.device), right=True)
        out = None
        for i, lo in enumerate(self.bounds[:-1]):
            mine = cluster == i                                           # (N,)
            e = self.emb_layers[i](torch.where(mine, flat - lo, 0))      # (N, n_i)
            p = self.projection(i)
            if p is not None:
                e = F.linear(e, p)                                        # (N, d_model)
            e = e.to(dtype)
            out = torch.where(mine.unsqueeze(1), e, 0.0 if out is None else out)
        return out.view(*ids.shape, self.d_model)


class ProjectedAdaptiveLogSoftmax(_Clusters):
    """Projected adaptive softmax over V words, optionally tied to an :class:`AdaptiveInput`.

    Args:
        vocab_size, d_model, cutoffs, div_val, emb_dim: as for :class:`AdaptiveInput`.
        tie_embeddings: an :class:`AdaptiveInput` of the same shape whose
            cluster embeddings become this module's output embeddings (the
            same ``Parameter`` objects); None for separate ones.
        tie_projections: share the input's projections too: one bool for
            every cluster, or one per cluster (head first). Needs
            ``tie_embeddings``.

    Attributes:
        out_embs: ``ParameterList`` of (c_i - c_{i-1}, n_i) output embeddings.
        out_biases: ``ParameterList`` of (c_i - c_{i-1},) output biases.
        out_projs: ``ParameterDict`` {str(i): (d_model, n_i)}, as in AdaptiveInput.
        cluster_weight, cluster_bias: the head's (n_tail, n_0) and (n_tail,)
            rows that score the tail clusters.
    """

    def __init__(self, vocab_size: int, d_model: int, *, cutoffs: Sequence[int],
                 div_val: int = 4, emb_dim: int = 1024,
                 tie_embeddings: Optional[AdaptiveInput] = None,
                 tie_projections: Union[bool, Sequence[bool]] = False,
                 device=None, dtype=None):
        super().__init__()
        self._init_clusters(vocab_size, d_model, cutoffs, div_val, emb_dim, device)
        n = len(self.widths)
        self.shortlist_size = self.cutoffs[0]
        self.n_tail = n - 1
        ties = [bool(tie_projections)] * n if isinstance(tie_projections, bool) \
            else [bool(t) for t in tie_projections]
        if len(ties) != n:
            raise ValueError(f"tie_projections needs one bool per cluster ({n}), got {len(ties)}")
        inp = tie_embeddings
        if inp is not None:
            if (inp.vocab_size, inp.d_model, inp.cutoffs, inp.widths) != \
                    (vocab_size, d_model, self.cutoffs, self.widths):
                raise ValueError("tie_embeddings: the AdaptiveInput's vocab_size, d_model, "
                                 "cutoffs, div_val and emb_dim must match the softmax's")
        elif any(ties):
            raise ValueError("tie_projections needs tie_embeddings (the AdaptiveInput to share "
                             "them with)")
        self.tied_embeddings = inp is not None
        self.tied_projections = ties
        factory = {"device": device, "dtype": dtype}
        sizes = [hi - lo for lo, hi in zip(self.bounds, self.bounds[1:])]
        if inp is not None:
            self.out_embs = nn.ParameterList([e.weight for e in inp.emb_layers])
        else:
            self.out_embs = nn.ParameterList(
                [nn.Parameter(torch.empty(s, w, **factory)) for s, w in zip(sizes, self.widths)])
        self.out_biases = nn.ParameterList(
            [nn.Parameter(torch.zeros(s, **factory)) for s in sizes])
        projs = {}
        for i, w in enumerate(self.widths):
            if w == d_model:
                continue
            projs[str(i)] = (inp.projection(i) if ties[i]
                             else nn.Parameter(torch.empty(d_model, w, **factory)))
        self.out_projs = nn.ParameterDict(projs)
        self.cluster_weight = nn.Parameter(torch.empty(self.n_tail, self.widths[0], **factory))
        self.cluster_bias = nn.Parameter(torch.zeros(self.n_tail, **factory))
        self.reset_parameters()

    def projection(self, i: int) -> Optional[nn.Parameter]:
        return self.out_projs[str(i)] if str(i) in self.out_projs else None

    def reset_parameters(self) -> None:
        """Initialise this module's own parameters; tied ones are left to their owner."""
        if not self.tied_embeddings:
            for e, w in zip(self.out_embs, self.widths):
                nn.init.normal_(e, 0.0, w ** -0.5)
        for i, tied in enumerate(self.tied_projections):
            p = self.projection(i)
            if p is not None and not tied:
                nn.init.normal_(p, 0.0, self.d_model ** -0.5)
        nn.init.normal_(self.cluster_weight, 0.0, self.widths[0] ** -0.5)
        for b in self.out_biases:
            nn.init.zeros_(b)
        nn.init.zeros_(self.cluster_bias)

    # ---------------------------------------------------------------- pieces
    def _project(self, h: Tensor, i: int) -> Tensor:
        p = self.projection(i)
        return h if p is None else torch.matmul(h, p)             # (N, d) @ (d, n_i)

    def _head_log_prob(self, h: Tensor) -> Tensor:
        """(N, shortlist + n_tail) fp32 log-probabilities of the head."""
        weight = torch.cat([self.out_embs[0], self.cluster_weight], 0)
        bias = torch.cat([self.out_biases[0], self.cluster_bias], 0)
        return F.log_softmax(_at_least_fp32(F.linear(self._project(h, 0), weight, bias)), dim=-1)

    def _tail_log_prob(self, h: Tensor, i: int) -> Tensor:
        """(N, size_i) fp32 log p(word | cluster i) for tail cluster i >= 1."""
        logits = F.linear(self._project(h, i), self.out_embs[i], self.out_biases[i])
        return F.log_softmax(_at_least_fp32(logits), dim=-1)

    # ---------------------------------------------------------------- public
    def log_prob(self, hidden: Tensor) -> Tensor:
        """Full log-probabilities: hidden (..., d_model) → (..., V), fp32 or wider.

        Computes every cluster: use it for generation and checks; train with
        :meth:`loss`, which computes only the clusters the targets need.
        """
        h = hidden.reshape(-1, self.d_model)
        head = self._head_log_prob(h)
        s = self.shortlist_size
        pieces = [head[:, :s]]
        for i in range(1, self.n_tail + 1):
            pieces.append(head[:, s + i - 1:s + i] + self._tail_log_prob(h, i))
        return torch.cat(pieces, -1).view(*hidden.shape[:-1], self.vocab_size)

    def forward(self, hidden: Tensor) -> Tensor:
        """The same as :meth:`log_prob` (a drop-in for a linear output layer's logits)."""
        return self.log_prob(hidden)

    def loss(self, hidden: Tensor, targets: Tensor, *, ignore_index: int = -100) -> Tensor:
        """Per-token negative log-likelihood, fp32 or wider.

        Args:
            hidden: (..., d_model).
            targets: (...) word ids; ``ignore_index`` positions get nll 0.
        Returns:
            nll with the shape of ``targets``. Only the tail clusters that some
            target falls into are computed, and only for those rows.
        """
        h = hidden.reshape(-1, self.d_model)
        t = targets.reshape(-1)
        if h.shape[0] != t.shape[0]:
            raise ValueError(f"hidden has {h.shape[0]} rows but targets {t.shape[0]}")
        ignored = t == ignore_index
        _check_on_device(~(((t < 0) | (t >= self.vocab_size)) & ~ignored).any(),
                         f"targets must be in [0, {self.vocab_size - 1}] "
                         f"(or {ignore_index} to ignore)")
        t = t.masked_fill(ignored, 0)
        cluster = torch.bucketize(t, self._cutoff_tensor.to(t.device), right=True)  # 0..n_tail
        s = self.shortlist_size
        head_col = torch.where(cluster == 0, t, s + cluster - 1)
        head = self._head_log_prob(h)
        nll = -head.gather(1, head_col.unsqueeze(1)).squeeze(1)
        for i in range(1, self.n_tail + 1):
            # The host reads each cluster's row count here (nonzero): on CUDA it waits
            # for the forward pass, once per tail cluster. Scoring every row in every
            # cluster instead (a mask, as AdaptiveInput does) would cost N·Σ size_i·n_i
            # multiply-adds more and an (N, size_i) logit matrix: 7-10% more FLOPs per
            # WikiText-103 step and 4 GB of fp32 logits at its batch (Billion Word:
            # 16% and 31 GB), against a wait that the backward's launches soon absorb.
            idx = (cluster == i).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            lp = self._tail_log_prob(h.index_select(0, idx), i)
            rel = (t.index_select(0, idx) - self.bounds[i]).unsqueeze(1)
            nll = nll.index_add(0, idx, -lp.gather(1, rel).squeeze(1))
        nll = nll.masked_fill(ignored, 0.0)
        return nll.view(targets.shape)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, tied_embeddings={self.tied_embeddings}, "
                f"tied_projections={self.tied_projections}")
