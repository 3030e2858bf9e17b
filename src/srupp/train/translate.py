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
split with beam search (``eval.beam``, ``eval.lenpen``). Both decode with
``eval.no_repeat_ngram_size`` (0, off, by default). The decoding itself
is :mod:`srupp.inference`'s (``translate_lines``), which ``srupp translate`` calls.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from .._extras import require
from ..data import LengthBatcher, build_tokenizer, load_table, tokenizer_from_dict
from ..errors import UserError, user_input
from ..inference import (autocast_context, encode_lines, encode_sources, length_batches,
                         pad_batch, translate_ids, translate_lines)
from ..runs import TOKENIZER
from .distributed import SINGLE, Dist
from .tasks import (SPEED_REPEATS, SentenceTask, Task, content_crc32, loss_sum, median_rate,
                    time_to_note)

SPEED_SENTENCES = 100  # compare: the first validation sentences timed
SPEED_BEAMS = (1, 5)   # compare: greedy, and the usual beam


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
    title = "translation"
    command = "translate"
    metric = "bleu"
    higher_is_better = True
    default_tokenizer = "sentencepiece"
    default_corpus = "iwslt14-de-en"
    depth_fields = ("encoder_layers", "decoder_layers")
    compare_columns = ("bleu", "chrf", *Task.compare_columns,
                       *(f"sentences_per_s_beam{b}" for b in SPEED_BEAMS))

    @classmethod
    def check_config(cls, cfg):
        if cfg.data.tokenizer != "sentencepiece":
            raise UserError(f"task=translate uses a joint sentencepiece tokenizer, not "
                            f"data.tokenizer={cfg.data.tokenizer}; unset data.tokenizer")

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        d = self.cfg.data
        with user_input():
            self.splits = load_table(self.table_source(), (d.src, d.tgt),
                                     test_size=d.test_size, valid_size=d.valid_size)
        self.check_splits(self.splits)
        with user_input():
            if saved is not None:
                self.tokenizer = tokenizer_from_dict(saved[TOKENIZER])
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
        return {TOKENIZER: self.tokenizer.to_dict()}

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
            e, d = self.cfg.eval, self.cfg.data
            sources = encode_sources(self.tokenizer, [r[0] for r in rows], max_len=d.max_len,
                                     truncate=d.truncate)
            scores = translation_scores(
                model, self.tokenizer, sources, [r[1] for r in rows],
                beam=e.beam if final else 1, lenpen=e.lenpen, max_len_a=e.max_len_a,
                max_len_b=e.max_len_b, no_repeat_ngram_size=e.no_repeat_ngram_size,
                max_tokens=self.cfg.train.max_tokens, precision=precision, dist=self.dist)
        finally:
            model.train(was_training)
        return {"bleu": scores["bleu"], "chrf": scores["chrf"], **res,
                "sentences": len(rows)}

    def summary_keys(self):
        return ("loss", "bleu", "chrf")

    def evaluate_checkpoint(self, model, tokenizer, ckpt, split):
        d, e = self.cfg.data, self.cfg.eval
        with user_input():
            rows = load_table(d.corpus, (d.src, d.tgt), test_size=d.test_size,
                              valid_size=d.valid_size).split(split)
            sources = encode_sources(tokenizer, [r[0] for r in rows], max_len=d.max_len,
                                     truncate=d.truncate)
        res = translation_scores(model, tokenizer, sources, [r[1] for r in rows],
                                 beam=e.beam, lenpen=e.lenpen, max_len_a=e.max_len_a,
                                 max_len_b=e.max_len_b,
                                 no_repeat_ngram_size=e.no_repeat_ngram_size,
                                 max_tokens=self.cfg.train.max_tokens)
        res.pop("hypotheses")
        return {**res, "beam": e.beam, "lenpen": e.lenpen,
                "no_repeat_ngram_size": e.no_repeat_ngram_size}

    def speed(self, model, device, precision, repeats=SPEED_REPEATS):
        """Sentences/s translating the first SPEED_SENTENCES validation sources, per beam
        in SPEED_BEAMS: ``{"sentences_per_s_beam1": ..., "sentences_per_s_beam5": ...}``.

        Batched as the run's evaluation is (``train.max_tokens`` source tokens per
        batch, the run's precision and length limits), so the figure is throughput.
        """
        cfg = self.cfg
        model.eval()
        rows = self.splits.valid[:SPEED_SENTENCES] or self.splits.train[:SPEED_SENTENCES]
        sources = [r[0] for r in rows]
        e, d = cfg.eval, cfg.data
        out = {}
        for beam in SPEED_BEAMS:
            def work(beam: int = beam) -> int:
                translate_lines(model, self.tokenizer, sources, beam=beam, lenpen=e.lenpen,
                                max_len_a=e.max_len_a, max_len_b=e.max_len_b,
                                no_repeat_ngram_size=e.no_repeat_ngram_size,
                                max_tokens=cfg.train.max_tokens, max_len=d.max_len,
                                truncate=d.truncate, precision=precision)
                return len(sources)
            out[f"sentences_per_s_beam{beam}"] = median_rate(work, device, repeats)
        return out

    @classmethod
    def compare_note(cls, metric, cfg):
        e = cfg.eval if cfg is not None else None
        beam = f"beam {e.beam}" if e else "beam search"
        capped = f"the first {e.bleu_sentences}" if e else "the first eval.bleu_sentences"
        return (f"Validation metric: **bleu** (higher is better). `final` translates the whole "
                f"validation split with {beam}; the curves' points during training are greedy "
                f"BLEU on {capped} validation sentences, their last point is the final one; "
                f"{time_to_note(True)} Speeds: sentences/s on the first {SPEED_SENTENCES} "
                f"validation sentences, batched as in evaluation (median of {SPEED_REPEATS} "
                f"after a warm-up).")


def translation_scores(model, tokenizer, sources: Sequence[Sequence[int]],
                       references: Sequence[str], *, dist: Dist = SINGLE,
                       **options) -> Dict[str, Any]:
    """Translate ``sources`` (ids, from :func:`srupp.inference.encode_sources`) and score
    them against ``references`` with sacrebleu.

    ``options`` are :func:`srupp.inference.translate_ids`'s. Returns BLEU and
    chrF (on detokenised text, sacrebleu's defaults), BLEU's signature, and the
    translation speed (sentences/s, and generated tokens/s, EOS included).
    Under torchrun (``dist``) each rank translates its share of the sentences
    and every rank scores them all.
    """
    sacrebleu = require("sacrebleu", "translation", "BLEU")
    start = time.perf_counter()
    ids = dist.map_shares(lambda part: translate_ids(model, part, **options), list(sources))
    seconds = time.perf_counter() - start
    hyps = [tokenizer.decode(x) for x in ids]
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(hyps, [list(references)])
    chrf_score = chrf.corpus_score(hyps, [list(references)])
    new_tokens = sum(len(x) + 1 for x, src in zip(ids, sources) if src)
    return {"bleu": bleu_score.score, "chrf": chrf_score.score,
            "signature": str(bleu.get_signature()), "sentences": len(sources),
            "seconds": seconds, "sentences_per_s": len(sources) / max(seconds, 1e-9),
            "tokens_per_s": new_tokens / max(seconds, 1e-9), "hypotheses": hyps}
