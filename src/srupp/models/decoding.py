"""Greedy and beam search for any translation model (:class:`~srupp.models.seq2seq.EncoderDecoder`).

Both encode the batch once, then advance every unfinished sentence (times
its beams) together, one :meth:`~srupp.models.seq2seq.EncoderDecoder.step` call per time step,
through the decoder state (:meth:`~srupp.models.seq2seq.EncoderDecoder.reorder` follows the beams
and drops finished sentences). Hypotheses start from ``config.bos_id`` and end
with ``config.eos_id``.

Maximum length: a sentence of n unpadded source tokens gets at most
``max_target_length(n, a, b) = max(1, floor(a·n + b))`` tokens before its
EOS; at that step EOS is forced (scored with its log-probability), so every
sentence yields a hypothesis.

Beam search (fairseq's rules):

- each step ranks the 2·beam best extensions of a sentence's live beams by
  their summed log-probability; an EOS among the first ``beam`` of them
  finishes that hypothesis, and the best ``beam`` extensions that are not EOS
  are the next live beams;
- a sentence stops as soon as it has ``beam`` finished hypotheses (it does
  not go on looking for a live beam that could still beat the worst of them);
- of its finished hypotheses the one of highest score is returned, the score
  being the length-penalised log-probability ``logprob / len ** lenpen``,
  with ``len`` the number of generated tokens, EOS included, and ``logprob``
  the sum of their log-probabilities (``lenpen=0``: the raw sum; larger
  ``lenpen`` favours longer outputs).

No repeated n-grams (fairseq's ``--no-repeat-ngram-size``): with
``no_repeat_ngram_size=n`` (0: off), a hypothesis may not produce an n-gram
of target tokens that it already contains. At each step, per hypothesis, the
tokens that would complete such an n-gram get log-probability -inf, in greedy
and in beam search alike. Only generated tokens count (not the start token),
and EOS is never banned, so a hypothesis can always end.

Every decision for a sentence reads only that sentence's scores, so a batch
gives each sentence what it gets decoded alone (up to float rounding of the
batched products). With ``beam=1`` beam search takes the same steps as
greedy search and gives the same tokens and log-probability.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._ranges import check
from .base import describe

__all__ = ["Hypothesis", "max_target_length", "repeated_ngram_tokens", "greedy_decode",
           "beam_search"]


@dataclass
class Hypothesis:
    """tokens: the output without EOS; score: the length-penalised score (beam search;
    greedy decoding's is its logprob); logprob: the sum
    of the token log-probabilities, EOS included."""

    tokens: List[int]
    score: float
    logprob: float


def max_target_length(src_len: int, a: float, b: int) -> int:
    """Most tokens before EOS for a source of ``src_len`` tokens: floor(a·src_len + b), >= 1."""
    return max(1, math.floor(a * src_len + b))


def _length_penalised(logprob: float, length: int, lenpen: float) -> float:
    """logprob / length ** lenpen (length counts EOS)."""
    return logprob / length ** lenpen


def repeated_ngram_tokens(tokens: Sequence[int], n: int) -> List[int]:
    """The tokens that, appended to ``tokens``, would repeat an n-gram already in them.

    The next token completes the n-gram (last n-1 tokens, next token); it is
    banned when an earlier n-gram starts with those same n-1 tokens. With n=1
    every token already generated is banned. A scan per step: hypotheses are short.
    """
    if n <= 0 or len(tokens) < n:
        return []
    last = list(tokens[len(tokens) - n + 1:])                     # [] for n=1
    return [tokens[i + n - 1] for i in range(len(tokens) - n + 1)
            if list(tokens[i:i + n - 1]) == last]


def _ban_repeated_ngrams(logp: Tensor, prefixes: Sequence[Sequence[int]], n: int) -> Tensor:
    """``logp`` (rows, V) with -inf at the tokens that would repeat an n-gram of each
    row's prefix; EOS is never one of them (a prefix never holds EOS)."""
    if n <= 0:
        return logp
    rows, cols = [], []
    for row, prefix in enumerate(prefixes):
        banned = repeated_ngram_tokens(prefix, n)
        rows += [row] * len(banned)
        cols += banned
    if not rows:
        return logp
    logp = logp.clone()
    logp[torch.tensor(rows, device=logp.device), torch.tensor(cols, device=logp.device)] = \
        float("-inf")
    return logp


def _prepare(model, src: Tensor, src_pad: Optional[Tensor], a: float, b: int,
             no_repeat_ngram_size: int) -> Tuple[List[int], int, int]:
    """Check the arguments; the maximum length of each sentence, bos and eos ids."""
    if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype != torch.long:
        raise ValueError(f"src must be a (B, S) long tensor of token ids, got {describe(src)}")
    if src.shape[0] == 0:
        raise ValueError("src has batch size 0; give at least one sentence")
    if src_pad is not None and (not isinstance(src_pad, Tensor) or src_pad.dtype != torch.bool
                                or src_pad.shape != src.shape):
        raise ValueError(f"src_pad must be a bool tensor shaped like src "
                         f"{tuple(src.shape)}, True at padding; got {describe(src_pad)}")
    check("max_len_a", a, ">= 0")
    check("max_len_b", b, "", integer=True)
    check("no_repeat_ngram_size", no_repeat_ngram_size, ">= 0", integer=True)
    S = src.shape[1]
    lengths = [S] * src.shape[0] if src_pad is None else (~src_pad).sum(1).tolist()
    return [max_target_length(n, a, b) for n in lengths], model.config.bos_id, model.config.eos_id


class _EvalMode:
    """Put a model in eval mode for a with block, then back in the mode it was in."""

    def __init__(self, model):
        self.model, self.was_training = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


@torch.no_grad()
def greedy_decode(model, src: Tensor, src_pad: Optional[Tensor] = None, *,
                  max_len_a: float = 1.2, max_len_b: int = 10,
                  no_repeat_ngram_size: int = 0) -> List[Hypothesis]:
    """The most likely token at each step, until EOS or the maximum length.

    Args:
        model: an EncoderDecoder (run in eval mode; its mode is restored after).
        src: (B, S) source ids.  src_pad: (B, S) bool, True at padding, or None.
        max_len_a, max_len_b: at most floor(a·n + b) tokens before EOS, n the
            sentence's unpadded source length.
        no_repeat_ngram_size: n > 0 bans repeating an n-gram of the output (0: off).
    Returns:
        B hypotheses, in the order of ``src`` (score = logprob).
    """
    max_len, bos, eos = _prepare(model, src, src_pad, max_len_a, max_len_b,
                                 no_repeat_ngram_size)
    with _EvalMode(model):
        state = model.init_decoder(model.encode(src, src_pad))
        B = src.shape[0]
        active = list(range(B))                                  # sentences still decoding
        tokens: List[List[int]] = [[] for _ in range(B)]
        out: List[Optional[Hypothesis]] = [None] * B
        inp = torch.full((B,), bos, dtype=torch.long, device=src.device)
        logprob = torch.zeros(B, device=src.device)              # (A,) fp32, as beam search
        for t in range(max(max_len) + 1):
            logp, state = model.step(inp, state)                 # (A, V)
            logp = _ban_repeated_ngrams(logp, [tokens[s] for s in active],
                                        no_repeat_ngram_size)
            forced = torch.tensor([t >= max_len[s] for s in active], device=logp.device)
            nxt = torch.where(forced, torch.full_like(inp, eos), logp.argmax(dim=-1))  # (A,)
            logprob = logprob + logp.gather(1, nxt.unsqueeze(1)).squeeze(1)
            keep = []
            for a, (s, w, lp) in enumerate(zip(active, nxt.tolist(), logprob.tolist())):
                if w == eos:
                    out[s] = Hypothesis(tokens[s], lp, lp)
                else:
                    tokens[s].append(w)
                    keep.append(a)
            if not keep:
                break
            if len(keep) < len(active):                          # drop finished sentences
                rows = torch.tensor(keep, device=src.device)
                state = model.reorder(state, rows)
                nxt, logprob = nxt[rows], logprob[rows]
                active = [active[a] for a in keep]
            inp = nxt
    return out


@torch.no_grad()
def beam_search(model, src: Tensor, src_pad: Optional[Tensor] = None, *, beam: int = 5,
                lenpen: float = 1.0, max_len_a: float = 1.2, max_len_b: int = 10,
                no_repeat_ngram_size: int = 0) -> List[Hypothesis]:
    """Batched beam search; the rules are in the module docstring.

    Args:
        model: an EncoderDecoder (run in eval mode; its mode is restored after).
        src: (B, S) source ids.  src_pad: (B, S) bool, True at padding, or None.
        beam: live hypotheses per sentence, and finished ones it waits for.
        lenpen: score = logprob / len ** lenpen, len = generated tokens including EOS;
            a finite number >= 0 (0: the raw sum; a negative one would favour short
            outputs even more than the raw sum does).
        max_len_a, max_len_b: at most floor(a·n + b) tokens before EOS, n the
            sentence's unpadded source length.
        no_repeat_ngram_size: n > 0 bans repeating an n-gram of the output (0: off).
    Returns:
        B hypotheses, the best finished one of each sentence, in the order of ``src``.
    """
    check("beam", beam, ">= 1", integer=True)
    check("lenpen", lenpen, ">= 0")
    max_len, bos, eos = _prepare(model, src, src_pad, max_len_a, max_len_b,
                                 no_repeat_ngram_size)
    K, B, device = beam, src.shape[0], src.device
    with _EvalMode(model):
        state = model.init_decoder(model.encode(src, src_pad))   # once per sentence,
        state = model.reorder(state, torch.arange(B, device=device).repeat_interleave(K))
        active = list(range(B))                                  # then K rows per sentence
        prefixes: List[List[int]] = [[] for _ in range(B * K)]   # row a·K + k: its tokens
        # cumulative log-probabilities of the live beams; at first only beam 0 is
        # live (the K rows are the same hypothesis)
        scores = torch.full((B, K), float("-inf"), device=device)
        scores[:, 0] = 0.0
        finished: List[List[Hypothesis]] = [[] for _ in range(B)]
        inp = torch.full((B * K,), bos, dtype=torch.long, device=device)
        for t in range(max(max_len) + 1):
            logp, state = model.step(inp, state)                 # (A·K, V)
            logp = _ban_repeated_ngrams(logp, prefixes, no_repeat_ngram_size)
            A, V = len(active), logp.shape[-1]
            logp = logp.view(A, K, V)
            forced = torch.tensor([t >= max_len[s] for s in active], device=logp.device)
            if bool(forced.any()):                               # only EOS is left
                only_eos = torch.full_like(logp, float("-inf"))
                only_eos[..., eos] = logp[..., eos]
                logp = torch.where(forced.view(A, 1, 1), only_eos, logp)
            cand = scores.unsqueeze(-1) + logp                   # (A, K, V)
            top, idx = cand.view(A, K * V).topk(min(2 * K, K * V), dim=-1)  # (A, 2K)
            rows, next_tokens, next_scores, keep = [], [], [], []
            for a, (s, sc_a, idx_a) in enumerate(zip(active, top.tolist(), idx.tolist())):
                live = []                                        # (row, token, score)
                for j, (sc, i) in enumerate(zip(sc_a, idx_a)):
                    if sc == float("-inf"):                      # sorted: the rest are dead too
                        break
                    row, w = a * K + i // V, i % V
                    if w == eos:
                        if j < K and len(finished[s]) < K:
                            n = len(prefixes[row]) + 1
                            finished[s].append(Hypothesis(
                                prefixes[row], _length_penalised(sc, n, lenpen), sc))
                    elif len(live) < K:
                        live.append((row, w, sc))
                if len(finished[s]) >= K or not live:
                    continue                                     # this sentence is done
                # fewer than K live extensions (a tiny vocabulary): pad with dead beams
                live += [(live[0][0], live[0][1], float("-inf"))] * (K - len(live))
                keep.append(s)
                for row, w, sc in live:
                    rows.append(row)
                    next_tokens.append(w)
                    next_scores.append(sc)
            if not keep:
                break
            prefixes = [prefixes[row] + [w] for row, w in zip(rows, next_tokens)]
            index = torch.tensor(rows, device=device)
            state = model.reorder(state, index)
            # fp32 values read out exactly, so these are the fp32 sums greedy search keeps
            scores = torch.tensor(next_scores, device=device).view(len(keep), K)
            inp = torch.tensor(next_tokens, device=device)
            active = keep
    return [max(hyps, key=lambda h: h.score) for hyps in finished]
