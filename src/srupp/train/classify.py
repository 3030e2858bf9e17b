"""Text classification: labelled texts from a TSV, accuracy and macro-F1.

Data: ``data.corpus`` is a TSV with a header (``data.text`` and
``data.label`` name the columns), split by :func:`srupp.data.load_table`'s
one rule, stratified by label so that every validation and test label occurs
in training; or a directory of ``train.tsv``/``valid.tsv``/``test.tsv``. The
tokenizer (``data.tokenizer``: word by default, or sentencepiece) is built
from the training texts; the labels are the training split's, sorted, and
saved with the run as ``labels.json``.

The logged ``train_loss`` and ``valid_loss`` are the mean cross-entropy per
text; tokens/s counts text tokens. Macro-F1 averages the F1 of every label
that occurs in the gold labels or the predictions. Classifying new text is
:mod:`srupp.inference`'s (``predict``, ``classify_lines``), which ``srupp classify`` calls.
"""

from __future__ import annotations

import time

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..data import LengthBatcher, build_tokenizer, load_table, tokenizer_from_dict
from ..errors import UserError, user_input
from ..inference import (autocast_context, checked_labels, encode_lines, fit_length,
                         length_batches, pad_batch, predict, to_device)
from ..runs import LABELS, TOKENIZER, labels_from_json
from .distributed import SINGLE, Dist
from .tasks import (SPEED_REPEATS, SentenceTask, Task, content_crc32, loss_sum, median_rate,
                    time_to_note)

SPEED_TEXTS = 1000  # compare: the first validation texts timed


class ClassificationTask(SentenceTask):
    name = "classify"
    title = "classification"
    command = "classify"
    metric = "macro_f1"
    higher_is_better = True
    file_names = (TOKENIZER, LABELS)
    default_tokenizer = "word"
    compare_columns = ("accuracy", "macro_f1", *Task.compare_columns, "texts_per_s")

    @classmethod
    def model_fields(cls, cfg, num_labels):
        return {"task": cls.name, "num_labels": num_labels if num_labels is not None else 2}

    @classmethod
    def output_labels(cls, cfg):
        """The training split's labels (2 without data)."""
        d = cfg.data
        if not d.corpus:
            return 2
        with user_input():
            splits = load_table(d.corpus, (d.text, d.label), stratify=d.label,
                                test_size=d.test_size, valid_size=d.valid_size)
        return len({label for _, label in splits.train})

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        d = self.cfg.data
        with user_input():
            self.splits = load_table(self.table_source(), (d.text, d.label), stratify=d.label,
                                     test_size=d.test_size, valid_size=d.valid_size)
        self.check_splits(self.splits)
        with user_input():
            if saved is not None:
                self.tokenizer = tokenizer_from_dict(saved[TOKENIZER])
                self.labels = labels_from_json(saved[LABELS], f"{LABELS} of this run")
            else:
                self.tokenizer = build_tokenizer(
                    d.tokenizer, "\n".join(r[0] for r in self.splits.train),
                    **d.tokenizer_options())
                self.labels = sorted({r[1] for r in self.splits.train})
        if len(self.labels) < 2:
            raise UserError(f"the training split of {d.corpus} has {len(self.labels)} label(s) "
                            f"in column {d.label!r}; classification needs at least 2")
        self.model_config = self.cfg.model_config(self.tokenizer.vocab_size, len(self.labels))
        self.train_items = self.encode_rows(self.splits.train, "the training split")
        self.valid_items = self.encode_rows(self.splits.valid, "the validation split")
        self.batcher = LengthBatcher(
            [len(ids) for ids, _ in self.train_items], self.cfg.train.max_tokens,
            seed=self.cfg.train.seed,
            content_crc32=content_crc32([ids + [-1 - y] for ids, y in self.train_items]))

    def encode_rows(self, rows: Sequence[Sequence[str]], where: str) -> List[tuple]:
        """(ids, label index) per row; a label training never saw is an error."""
        ids = self.fit_lengths(encode_lines(self.tokenizer, [r[0] for r in rows]),
                               f"the texts of {where}", keep_last=False)
        with user_input():
            return list(zip(ids, label_indices(self.labels, [r[1] for r in rows], where)))

    def files(self) -> Dict[str, Any]:
        return {TOKENIZER: self.tokenizer.to_dict(), LABELS: {"labels": self.labels}}

    def loss(self, model, batch, carried, device, precision):
        mine, counts = self.rank_share(batch.indices)
        items = [self.train_items[i] for i in mine]
        tokens, pad = pad_batch([ids for ids, _ in items], device)
        labels = to_device(torch.tensor([y for _, y in items]), device)
        with autocast_context(precision, device.type):
            out = model(tokens, mask_pad=pad, labels=labels)
        if not counts:
            return out.loss * 0.0, 0.0, 0, 0, None
        tokens_read = sum(len(ids) for ids, _ in items)  # on the host: no wait for the device
        return out.loss, loss_sum(out.loss, len(items)), len(items), tokens_read, None

    def validate(self, model, precision, *, final, max_batches):
        return classification_scores(model, self.valid_items, len(self.labels),
                                     max_tokens=self.cfg.train.max_tokens, precision=precision,
                                     max_batches=None if final else max_batches,
                                     dist=self.dist)

    def summary_keys(self):
        return ("loss", "accuracy", "macro_f1")

    def evaluate_checkpoint(self, model, tokenizer, ckpt, split):
        d = self.cfg.data
        labels = checked_labels(ckpt, model)
        # a split directory's labels are checked against the model's below, not its train.tsv
        stratify = None if Path(d.corpus).is_dir() else d.label  # a file: split as in training
        with user_input():
            rows = load_table(d.corpus, (d.text, d.label), stratify=stratify,
                              test_size=d.test_size, valid_size=d.valid_size).split(split)
        if not rows:  # scores of no texts are undefined
            fix = f" or set data.{split}_size above 0" if split in ("valid", "test") else ""
            raise UserError(f"the {split} split of {d.corpus} is empty; evaluate another "
                            f"--split{fix}")
        with user_input():
            gold = label_indices(labels, [r[1] for r in rows], f"the {split} split of {d.corpus}")
            ids = fit_length(encode_lines(tokenizer, [r[0] for r in rows]), d.max_len,
                             truncate=d.truncate, where=f"the {split} split", keep_last=False)
        start = time.perf_counter()
        res = classification_scores(model, list(zip(ids, gold)), len(labels),
                                    max_tokens=self.cfg.train.max_tokens)
        seconds = time.perf_counter() - start
        return {**res, "seconds": seconds, "texts_per_s": len(rows) / max(seconds, 1e-9)}

    def speed(self, model, device, precision, repeats=SPEED_REPEATS):
        """Texts/s classifying the first SPEED_TEXTS validation texts (already tokenized),
        batched under ``train.max_tokens`` in the run's precision: ``{"texts_per_s": ...}``."""
        items = [ids for ids, _ in (self.valid_items[:SPEED_TEXTS]
                                    or self.train_items[:SPEED_TEXTS])]

        def work() -> int:
            predict(model, items, max_tokens=self.cfg.train.max_tokens, precision=precision)
            return len(items)

        return {"texts_per_s": median_rate(work, device, repeats)}

    @classmethod
    def compare_note(cls, metric, cfg):
        return (f"Validation metric: **macro_f1** (higher is better), on the validation split; "
                f"{time_to_note(True)} texts_per_s: classifying the first {SPEED_TEXTS} "
                f"validation texts, batched as in evaluation (median of {SPEED_REPEATS} after "
                f"a warm-up).")


def label_indices(labels: Sequence[str], given: Sequence[str], where: str) -> List[int]:
    """The index of each label in ``labels``; ValueError listing the known ones for others."""
    index = {name: i for i, name in enumerate(labels)}
    unseen = sorted({g for g in given if g not in index})
    if unseen:
        shown = ", ".join(repr(u) for u in unseen[:5]) + (" ..." if len(unseen) > 5 else "")
        raise ValueError(f"{where} has label(s) training never saw: {shown}; "
                         f"the known labels are {', '.join(labels)}")
    return [index[g] for g in given]


@torch.no_grad()
def classification_scores(model, items: Sequence[tuple], num_labels: int, *,
                          max_tokens: int = 4096, precision: str = "fp32",
                          max_batches: Optional[int] = None,
                          dist: Dist = SINGLE) -> Dict[str, float]:
    """Loss, accuracy and macro-F1 of ``items`` ((ids, label index) pairs).

    With ``max_batches``, only the texts of that many length batches (a fixed
    random choice) count. Under torchrun (``dist``) each rank predicts its
    share of the texts and every rank scores them all.
    """
    if max_batches is not None:
        batches = length_batches([len(x) for x, _ in items], max_tokens, max_batches)
        items = [items[i] for idx in batches for i in idx]

    def probabilities(part):
        if not part:
            return []
        return list(predict(model, [x for x, _ in part], max_tokens=max_tokens,
                            precision=precision))

    probs = torch.stack(dist.map_shares(probabilities, list(items)))
    gold = torch.tensor([y for _, y in items])
    pred = probs.argmax(-1)
    loss = -probs[torch.arange(len(items)), gold].clamp_min(1e-30).log().mean()
    return {"loss": float(loss), "accuracy": float((pred == gold).float().mean()),
            "macro_f1": macro_f1(gold, pred, num_labels), "texts": len(items)}


def macro_f1(gold: torch.Tensor, pred: torch.Tensor, num_labels: int) -> float:
    """The mean F1 over labels that occur in ``gold`` or ``pred``."""
    f1s = []
    for c in range(num_labels):
        g, p = gold == c, pred == c
        if not (g.any() or p.any()):
            continue
        tp = int((g & p).sum())
        f1s.append(2 * tp / (int(g.sum()) + int(p.sum())))
    return sum(f1s) / len(f1s) if f1s else 0.0
