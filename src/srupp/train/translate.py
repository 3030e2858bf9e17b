"""Translation: sentence pairs from a TSV, a joint SentencePiece BPE, BLEU and chrF.

Data: ``data.corpus`` is a TSV with a header (``data.src`` and ``data.tgt``
name the columns, split by :func:`srupp.data.load_table`'s one rule), a
directory of ``train.tsv``/``valid.tsv``/``test.tsv``, or ``iwslt14-de-en``.
The tokenizer is one SentencePiece model (BPE by default) trained on the
training split's sources and targets together, saved with the run.

Sources are their pieces then ``<eos>``; the decoder reads ``<eos>`` (as its
start token) then the target's pieces, and predicts the pieces then ``<eos>``.
Batches hold sentences of similar length, at most ``train.max_tokens`` padded
tokens per side. The loss is label-smoothed (``train.label_smoothing``); the
logged ``train_loss`` and ``valid_loss`` are the plain negative
log-likelihood per target token, and tokens/s counts target tokens.

Validation during training: the loss, and BLEU and chrF of greedy
translations of the first ``eval.bleu_sentences`` validation sentences, so
that it does not eat the budget; the final evaluation translates the whole
split with beam search (``eval.beam``, ``eval.lenpen``).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from .._extras import require
from .._ranges import check
from ..data import LengthBatcher, build_tokenizer, load_table, tokenizer_from_dict
from ..errors import UserError
from ..models.decoding import beam_search, greedy_decode
from .distributed import SINGLE, Dist
from .evaluate import autocast_context
from .tasks import (SentenceTask, content_crc32, encode_lines, fit_length, length_batches,
                    loss_sum, pad_batch)


class PairBatch:
    """A batch of pairs: src (B, S), src_pad, tgt_in (B, T), tgt_pad, targets (-100 at padding)."""

    def __init__(self, pairs, device):
        self.src, self.src_pad = pad_batch([s for s, _ in pairs], device)
        # decoder input: <eos> as start, then the pieces; targets: the pieces, then <eos>
        tgt = [t for _, t in pairs]
        self.tgt_in, self.tgt_pad = pad_batch([t[-1:] + t[:-1] for t in tgt], device)
        targets, _ = pad_batch(tgt, device)
        self.targets = targets.masked_fill(self.tgt_pad, -100)
        self.tokens = sum(len(t) for t in tgt)  # counted on the host: no wait for the device


class TranslationTask(SentenceTask):
    name = "translate"
    metric = "bleu"
    higher_is_better = True

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        d = self.cfg.data
        self.splits = load_table(self.table_source(), (d.src, d.tgt), test_size=d.test_size,
                                 valid_size=d.valid_size)
        self.check_splits(self.splits)
        if saved is not None:
            self.tokenizer = tokenizer_from_dict(saved["tokenizer.json"])
        else:
            joint = "\n".join(text for pair in self.splits.train for text in pair)
            self.tokenizer = build_tokenizer("sentencepiece", joint, **d.tokenizer_options())
        eos = self.tokenizer.eos_id
        self.model_config = self.cfg.model_config(self.tokenizer.vocab_size)
        if (self.model_config.bos_id, self.model_config.eos_id) != (eos, eos):
            raise UserError(f"model.bos_id and model.eos_id must be the tokenizer's <eos> "
                            f"({eos}); unset them")
        self.train_pairs = self.encode_pairs(self.splits.train, "the training split")
        self.valid_pairs = self.encode_pairs(self.splits.valid, "the validation split")
        self.batcher = LengthBatcher(
            [max(len(s), len(t)) for s, t in self.train_pairs], self.cfg.train.max_tokens,
            seed=self.cfg.train.seed,
            content_crc32=content_crc32([s + t for s, t in self.train_pairs]))

    def encode_pairs(self, rows: Sequence[Sequence[str]], where: str) -> List[tuple]:
        src = self.fit_lengths(encode_lines(self.tokenizer, [r[0] for r in rows]),
                               f"the sources of {where}")
        tgt = self.fit_lengths(encode_lines(self.tokenizer, [r[1] for r in rows]),
                               f"the targets of {where}")
        return list(zip(src, tgt))

    def files(self) -> Dict[str, Any]:
        return {"tokenizer.json": self.tokenizer.to_dict()}

    def loss(self, model, batch, carried, device, precision):
        mine, counts = self.rank_share(batch.indices)
        b = PairBatch([self.train_pairs[i] for i in mine], device)
        with autocast_context(precision, device.type):
            out = model(b.src, b.tgt_in, src_pad=b.src_pad, tgt_pad=b.tgt_pad,
                        targets=b.targets, label_smoothing=self.cfg.train.label_smoothing)
        if not counts:
            return out.loss * 0.0, 0.0, 0, 0, None
        return out.loss, loss_sum(out.nll, b.tokens), b.tokens, b.tokens, None

    @torch.no_grad()
    def valid_loss(self, model, precision: str, max_batches: Optional[int]) -> Dict[str, float]:
        """Mean negative log-likelihood per target token on the validation split
        (its batches shared across ranks under torchrun)."""
        device = model.device

        def sums(batches):
            out_sums = []
            for idx in batches:
                b = PairBatch([self.valid_pairs[j] for j in idx], device)
                with autocast_context(precision, device.type):
                    out = model(b.src, b.tgt_in, src_pad=b.src_pad, tgt_pad=b.tgt_pad,
                                targets=b.targets)
                out_sums.append((out.nll.item() * b.tokens, b.tokens))
            return out_sums

        per_batch = self.dist.map_shares(sums, length_batches(
            [max(len(s), len(t)) for s, t in self.valid_pairs], self.cfg.train.max_tokens,
            max_batches))
        total = sum(s for s, _ in per_batch)
        count = sum(n for _, n in per_batch)
        return {"loss": total / max(count, 1), "tokens": count}

    def validate(self, model, precision, *, final, max_batches):
        was_training = model.training
        model.eval()
        try:
            res = self.valid_loss(model, precision, None if final else max_batches)
            rows = self.splits.valid if final else self.splits.valid[:self.cfg.eval.bleu_sentences]
            e = self.cfg.eval
            scores = translation_scores(
                model, self.tokenizer, [r[0] for r in rows], [r[1] for r in rows],
                beam=e.beam if final else 1, lenpen=e.lenpen, max_len_a=e.max_len_a,
                max_len_b=e.max_len_b, max_tokens=self.cfg.train.max_tokens,
                max_len=self.cfg.data.max_len, truncate=self.cfg.data.truncate,
                precision=precision, dist=self.dist)
        finally:
            model.train(was_training)
        return {"bleu": scores["bleu"], "chrf": scores["chrf"], **res,
                "sentences": len(rows)}

    def summary_keys(self):
        return ("loss", "bleu", "chrf")


def translate_lines(model, tokenizer, lines: Sequence[str], *, beam: int = 5,
                    lenpen: float = 1.0, max_len_a: float = 1.2, max_len_b: int = 10,
                    max_tokens: int = 4096, max_len: Optional[int] = None,
                    truncate: bool = False, precision: str = "fp32",
                    first_line: int = 1) -> List[str]:
    """Translate ``lines`` (in order); an empty line gives an empty translation.

    Sentences are batched by length (at most ``max_tokens`` padded source
    tokens per batch), decoded greedily (``beam`` 1) or with beam search, and
    detokenised. A source longer than ``max_len`` tokens is a ValueError
    naming its line (``first_line`` is the number of ``lines[0]``), or is cut
    to it, with a warning, when ``truncate``.
    """
    return [tokenizer.decode(ids) for ids in _translate_ids(
        model, tokenizer, lines, beam=beam, lenpen=lenpen, max_len_a=max_len_a,
        max_len_b=max_len_b, max_tokens=max_tokens, max_len=max_len, truncate=truncate,
        precision=precision, first_line=first_line)]


def _translate_ids(model, tokenizer, lines, *, beam, lenpen, max_len_a, max_len_b, max_tokens,
                   max_len, truncate, precision, first_line) -> List[List[int]]:
    """The translations' token ids (EOS excluded); see :func:`translate_lines`."""
    check("beam", beam, ">= 1", integer=True)
    check("lenpen", lenpen, ">= 0")  # beam_search's, checked for greedy (beam 1) too
    check("max_len", max_len, ">= 1", integer=True)
    out: List[List[int]] = [[] for _ in lines]
    todo = [i for i, ln in enumerate(lines) if ln.strip()]
    if not todo:
        return out
    src = encode_lines(tokenizer, [lines[i] for i in todo])
    if max_len is not None:
        long = [k for k, s in enumerate(src) if len(s) > max_len]
        if long and not truncate:
            raise ValueError(f"line {first_line + todo[long[0]]} has {len(src[long[0]])} source "
                             f"tokens, more than the model's max_len={max_len}; shorten it, "
                             f"or truncate")
        src = fit_length(src, max_len, truncate=True, where="the input")
    device = model.device
    for idx in length_batches([len(s) for s in src], max_tokens):
        ids, pad = pad_batch([src[k] for k in idx], device)
        with autocast_context(precision, device.type):
            if beam == 1:
                hyps = greedy_decode(model, ids, pad, max_len_a=max_len_a, max_len_b=max_len_b)
            else:
                hyps = beam_search(model, ids, pad, beam=beam, lenpen=lenpen,
                                   max_len_a=max_len_a, max_len_b=max_len_b)
        for k, h in zip(idx, hyps):
            out[todo[k]] = h.tokens
    return out


def translation_scores(model, tokenizer, sources: Sequence[str], references: Sequence[str],
                       *, dist: Dist = SINGLE, **options) -> Dict[str, Any]:
    """Translate ``sources`` and score them against ``references`` with sacrebleu.

    Returns BLEU and chrF (on detokenised text, sacrebleu's defaults), BLEU's
    signature, and the translation speed (sentences/s, and generated tokens/s,
    EOS included). Under torchrun (``dist``) each rank translates its share
    of the sentences and every rank scores them all.
    """
    sacrebleu = require("sacrebleu", "translation", "BLEU")
    start = time.perf_counter()
    options = {"beam": 5, "lenpen": 1.0, "max_len_a": 1.2, "max_len_b": 10, "max_tokens": 4096,
               "max_len": None, "truncate": False, "precision": "fp32", "first_line": 1,
               **options}
    ids = dist.map_shares(lambda part: _translate_ids(model, tokenizer, part, **options),
                          list(sources))
    seconds = time.perf_counter() - start
    hyps = [tokenizer.decode(x) for x in ids]
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hyps, [list(references)])
    chrf_score = chrf.corpus_score(hyps, [list(references)])
    new_tokens = sum(len(x) + 1 for x, src in zip(ids, sources) if src.strip())
    return {"bleu": bleu_score.score, "chrf": chrf_score.score,
            "signature": str(bleu.get_signature()), "sentences": len(sources),
            "seconds": seconds, "sentences_per_s": len(sources) / max(seconds, 1e-9),
            "tokens_per_s": new_tokens / max(seconds, 1e-9), "hypotheses": hyps}
