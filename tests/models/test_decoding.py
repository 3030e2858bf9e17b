"""Greedy and beam search: on stubs with fixed log-probabilities, and on the SRU++ model."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from srupp.models.decoding import (Hypothesis, beam_search, greedy_decode, max_target_length,
                                   repeated_ngram_tokens)
from srupp.models import EncoderDecoder, EncoderOutput, SRUppSeq2SeqConfig

PAD, EOS, A, B = 0, 1, 2, 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes (tests/conftest.py)


class TableModel(EncoderDecoder):
    """An EncoderDecoder whose next-token probabilities are ``table(prefix)``: those of
    [EOS, A, B], PAD taking the rest; prefix is the tuple of tokens generated so far.

    It records the rows of each step.
    """

    def __init__(self, table):
        nn.Module.__init__(self)
        self.config = SimpleNamespace(bos_id=EOS, eos_id=EOS)
        self.table = table
        self.rows = []

    def encode(self, src, src_pad=None):
        return EncoderOutput(src.unsqueeze(-1).float(), src_pad)

    def init_decoder(self, enc):
        return torch.zeros(enc.states.shape[0], 0, dtype=torch.long)    # (B, 0): the prefix

    def reorder(self, state, index):
        return state.index_select(0, index)

    def step(self, tokens, state):
        self.rows.append(tokens.shape[0])
        state = torch.cat([state, tokens.unsqueeze(1)], 1)               # bos first
        rows = [self.table(tuple(r[1:])) for r in state.tolist()]
        p = torch.tensor([[1 - sum(r), *r] for r in rows], dtype=torch.float64)
        return p.log().float(), state


def lp(*probs):
    """The fp32 log-probabilities of a path, summed as the search sums them."""
    return float(sum(torch.tensor(probs, dtype=torch.float64).log().float()))


def test_max_target_length():
    assert max_target_length(10, 1.2, 10) == 22
    assert max_target_length(5, 1.5, 0) == 7            # floor(7.5)
    assert max_target_length(3, 0.0, 0) == 1            # at least one token
    assert max_target_length(4, 0.5, -10) == 1


def test_beam_search_finds_a_better_hypothesis_than_greedy():
    def table(prefix):
        return {(): [.001, .6, .39],            # greedy takes A ...
                (A,): [.34, .33, .32],          # ... then its best is EOS: .6 · .34 = .204
                (B,): [.97, .01, .01]}.get(prefix, [.9, .05, .04])  # B EOS: .39 · .97 = .378
    src = torch.tensor([[5, 6, 7]])
    g = greedy_decode(TableModel(table), src)[0]
    b = beam_search(TableModel(table), src, beam=2, lenpen=0.0)[0]
    assert g.tokens == [A] and b.tokens == [B]
    assert g.logprob == lp(.6, .34) and b.logprob == lp(.39, .97)
    assert b.score > g.score


def test_length_penalty_is_logprob_over_length_to_the_power():
    def table(prefix):
        return {(): [1e-4, .5, .49],
                (A,): [.9, .05, .04],            # A EOS: .45, 2 tokens
                (B,): [.15, .04, .8],            # B B EOS: .49 · .8 · .95 = .3724, 3 tokens
                (B, B): [.95, .02, .02]}.get(prefix, [.5, .25, .24])
    src = torch.tensor([[5, 6, 7]])
    raw = beam_search(TableModel(table), src, beam=2, lenpen=0.0)[0]
    assert raw.tokens == [A] and raw.score == raw.logprob
    for lenpen in (1.0, 2.0):
        long = beam_search(TableModel(table), src, beam=2, lenpen=lenpen)[0]
        assert long.tokens == [B, B]
        assert long.logprob == lp(.49, .8, .95)
        assert long.score == pytest.approx(long.logprob / 3 ** lenpen, rel=1e-12)
    assert raw.logprob == lp(.5, .9)
    # lenpen=1 prefers [B, B] (-0.33 against -0.40 for [A]); lenpen=0 the other way round
    assert math.log(.45) / 2 < math.log(.3724) / 3 and math.log(.45) > math.log(.3724)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_max_length_forces_eos_and_eos_ends_hypotheses(search):
    never = lambda prefix: [1e-4, .6, .39]  # noqa: E731  (EOS never wins)
    src = torch.tensor([[4, 5, 6, 7, 8, 9], [4, 5, 6, 0, 0, 0], [4, 5, 6, 7, 8, 0]])
    pad = src == 0
    model = TableModel(never)
    run = (lambda m, **kw: greedy_decode(m, src, pad, **kw)) if search == "greedy" else \
        (lambda m, **kw: beam_search(m, src, pad, beam=2, lenpen=0.0, **kw))
    hyps = run(model, max_len_a=1.0, max_len_b=2)
    assert [len(h.tokens) for h in hyps] == [8, 5, 7]    # floor(1·n + 2), n = 6, 3, 5
    if search == "greedy":
        assert hyps[1].tokens == [A] * 5
        assert hyps[1].logprob == lp(.6, .6, .6, .6, .6, 1e-4)   # the forced EOS counts
    # one step call per position for all sentences (× beams) together; a sentence leaves
    # the batch once done (sentence 1 after its 6th step, 2 after its 8th)
    k = 1 if search == "greedy" else 2
    assert model.rows == [3 * k] * 6 + [2 * k] * 2 + [k]
    # a model that says EOS after two tokens stops there
    stops = lambda prefix: [.9, .06, .03] if len(prefix) == 2 else [.1, .5, .39]  # noqa: E731
    assert [h.tokens for h in run(TableModel(stops))] == [[A, A]] * 3


def test_repeated_ngram_tokens_are_those_that_complete_an_ngram_seen_before():
    assert repeated_ngram_tokens([A, B, A], 2) == [B]           # (A, B) again
    assert repeated_ngram_tokens([A, B, A, B], 3) == [A]        # (A, B, A) again
    assert repeated_ngram_tokens([A, B, A], 1) == [A, B, A]     # every token seen
    assert repeated_ngram_tokens([A, B], 3) == []               # no full 3-gram yet
    assert repeated_ngram_tokens([A, A], 0) == []               # off


def _has_repeated_ngram(tokens, n):
    ngrams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(ngrams)) < len(ngrams)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_no_repeat_ngram_size_bans_repeats_per_hypothesis(search):
    """A model that always prefers A (then B, then EOS) repeats A until the maximum length;
    with no_repeat_ngram_size=n no n-gram of the output comes twice."""
    prefers_a = lambda prefix: [.1, .6, .3]  # noqa: E731
    src = torch.tensor([[5, 6, 7], [5, 6, 0]])
    pad = src == 0

    def run(**kw):
        if search == "greedy":
            return greedy_decode(TableModel(prefers_a), src, pad, **kw)
        return beam_search(TableModel(prefers_a), src, pad, beam=2, lenpen=1.0, **kw)

    free = run()
    assert free == run(no_repeat_ngram_size=0)                  # 0: off, nothing changes
    assert all(_has_repeated_ngram(h.tokens, 2) for h in free)
    for n in (1, 2):
        hyps = run(no_repeat_ngram_size=n)
        assert all(not _has_repeated_ngram(h.tokens, n) for h in hyps), (n, hyps)
        assert all(h.logprob > float("-inf") for h in hyps)     # ended by EOS, never banned
        if search == "greedy":
            # n=1: A, then B (A is taken), then only EOS is left;
            # n=2: A A, then B (A A is taken), A, then only EOS (A A and A B are taken)
            want = [A, B] if n == 1 else [A, A, B, A]
            assert [h.tokens for h in hyps] == [want, want]
            assert hyps[0].logprob == (lp(.6, .3, .1) if n == 1 else lp(.6, .6, .3, .6, .1))
    # beam 1 is greedy search, with the ban too
    one = beam_search(TableModel(prefers_a), src, pad, beam=1, no_repeat_ngram_size=2)
    assert [(h.tokens, h.logprob) for h in one] == \
        [(h.tokens, h.logprob) for h in greedy_decode(TableModel(prefers_a), src, pad,
                                                      no_repeat_ngram_size=2)]


def test_search_arguments_are_checked():
    model = TableModel(lambda prefix: [.5, .25, .24])
    with pytest.raises(ValueError, match="beam must be >= 1, got 0"):
        beam_search(model, torch.tensor([[2]]), beam=0)
    for search in (greedy_decode, beam_search):
        with pytest.raises(ValueError, match="no_repeat_ngram_size must be >= 0, got -1"):
            search(model, torch.tensor([[2]]), no_repeat_ngram_size=-1)
        with pytest.raises(TypeError, match="no_repeat_ngram_size must be an integer"):
            search(model, torch.tensor([[2]]), no_repeat_ngram_size=1.5)
    with pytest.raises(ValueError, match=r"src must be a \(B, S\) long tensor"):
        greedy_decode(model, torch.tensor([[2.0]]))
    with pytest.raises(ValueError, match="src_pad must be a bool tensor shaped like src"):
        greedy_decode(model, torch.tensor([[2, 3]]), torch.tensor([[0, 1]]))


# ------------------------------------------------------------------ the SRU++ model

# The stubs above run on the CPU (their tables are Python); the SRU++ model runs on the
# device: the search's own tensors (scores, tokens, the reorder index) live on src's device.

def make(design, device):
    """Built on the CPU (the same weights whatever the device), moved to device."""
    torch.manual_seed(0)
    m = EncoderDecoder(SRUppSeq2SeqConfig(vocab_size=20, d_model=16, encoder_layers=2,
                                   decoder_layers=2, dropout=0.3, cross_attention=design,
                                   tie_embeddings=False))
    with torch.no_grad():  # give attention a say (α starts at 0)
        for module in m.modules():
            if hasattr(module, "alpha"):
                module.alpha.fill_(0.8)
    return m.to(device)


def sources(device):
    g = torch.Generator().manual_seed(3)
    src = torch.randint(2, 20, (4, 7), generator=g)
    pad = torch.zeros(4, 7, dtype=torch.bool)
    pad[1, 3:] = True
    pad[3, 5:] = True
    return src.to(device), pad.to(device)


@pytest.mark.parametrize("design", ["memory", "sublayer"])
def test_beam_one_is_greedy_in_eval_mode(design, device):
    m = make(design, device).train()                     # dropout 0.3: eval must be switched on
    src, pad = sources(device)
    greedy = greedy_decode(m, src, pad, max_len_b=4)
    assert m.training                                    # the mode is given back
    beam1 = beam_search(m, src, pad, beam=1, max_len_b=4)
    assert [(h.tokens, h.logprob) for h in beam1] == [(h.tokens, h.logprob) for h in greedy]
    no_repeats = [beam_search(m, src, pad, beam=1, max_len_b=4, no_repeat_ngram_size=1),
                  greedy_decode(m, src, pad, max_len_b=4, no_repeat_ngram_size=1)]
    assert [(h.tokens, h.logprob) for h in no_repeats[0]] == \
        [(h.tokens, h.logprob) for h in no_repeats[1]]
    assert all(len(set(h.tokens)) == len(h.tokens) for h in no_repeats[1])
    assert greedy == greedy_decode(m.eval(), src, pad, max_len_b=4)
    assert all(isinstance(h, Hypothesis) and h.score == h.logprob for h in greedy)
    assert len({tuple(h.tokens) for h in greedy}) > 1     # the outputs differ: a real check


@pytest.mark.parametrize("design", ["memory", "sublayer"])
def test_batched_beam_search_equals_one_sentence_at_a_time(design, device):
    m = make(design, device).eval()
    src, pad = sources(device)
    batched = beam_search(m, src, pad, beam=4, lenpen=1.0, max_len_b=4)
    for b, hyp in enumerate(batched):
        n = int((~pad[b]).sum())
        alone = beam_search(m, src[b:b + 1, :n], beam=4, lenpen=1.0, max_len_b=4)[0]
        assert hyp.tokens == alone.tokens
        # equal up to the rounding of batched products (measured 2e-7)
        assert hyp.score == pytest.approx(alone.score, abs=1e-5)
        assert hyp.logprob == pytest.approx(alone.logprob, abs=1e-5)
        assert len(hyp.tokens) <= max_target_length(n, 1.2, 4)
