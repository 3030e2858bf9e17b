"""What each task supplies to the one training loop (:class:`~srupp.train.Trainer`).

A task owns its data, tokenizer (and labels), batches, loss and evaluation;
the trainer owns everything else: the optimiser and schedule, the time
budget, precision, checkpoints and exact resume, progress, metrics and
curves. Three tasks, chosen by the recipe's top-level ``task`` key:

    lm         language modelling (this module): streams of tokens, state carried
    translate  :mod:`srupp.train.translate`: sentence pairs, BLEU
    classify   :mod:`srupp.train.classify`: labelled texts, accuracy and macro-F1
"""

from __future__ import annotations

import math
import random
import warnings
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..data import (LengthBatcher, StreamBatcher, build_tokenizer, load_corpus,
                    tokenizer_from_dict)
from ..errors import UserError
from .config import RunConfig
from .device import to_device
from .distributed import SINGLE, Dist
from .evaluate import autocast_context, evaluate, metric_for


def check_tokenizer_fits(tokenizer, text: str, max_oov: float, where: str) -> float:
    rate = tokenizer.oov_rate(text)
    if rate > max_oov:
        raise UserError(
            f"the saved {tokenizer.to_dict()['type']} tokenizer does not fit {where}: "
            f"{rate:.1%} of it is out of vocabulary (data.max_oov={max_oov:.1%}); "
            f"use the data the run was trained on, or raise data.max_oov")
    return rate


class Task:
    """The interface a task gives the trainer.

    After :meth:`load`: ``model_config`` (the model to build), ``batcher``
    (``iter_from(position)``, ``position``, ``state_dict()``,
    ``load_state_dict()``), ``metric`` (the main validation metric's name)
    and ``higher_is_better`` (for that metric).
    """

    name = ""
    # the files saved with the run and with every checkpoint, beside the model
    file_names: Tuple[str, ...] = ("tokenizer.json",)
    metric = "loss"
    higher_is_better = False
    carries_state = False  # the LM carries its recurrent state from batch to batch
    weighted_accumulation = False  # micro-batches differ in size: weight them by their count

    def __init__(self, cfg: RunConfig, dist: Dist = SINGLE):
        self.cfg = cfg
        self.dist = dist  # under torchrun: this rank's share of the batches and of evaluation

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        """Read the data and build the tokenizer, or take it from ``saved`` (a resumed run's files)."""
        raise NotImplementedError

    def files(self) -> Dict[str, Any]:
        """``{file name: JSON}`` for :attr:`file_names`."""
        raise NotImplementedError

    def loss(self, model, batch, carried, device, precision: str
             ) -> Tuple[torch.Tensor, Any, int, int, Any]:
        """One micro-batch: (loss to backpropagate (a mean), its sum (:func:`loss_sum`,
        or 0.0 when it does not count), its count, tokens read, the state to carry).

        Nothing here may read a value back from the device: on CUDA that waits
        for the GPU, every step (see :mod:`srupp.train.device`).
        """
        raise NotImplementedError

    def validate(self, model, precision: str, *, final: bool,
                 max_batches: Optional[int]) -> Dict[str, float]:
        """``{"loss": ..., metric: ..., ...}``: each key is logged as ``valid_<key>``.

        ``final``: the end-of-run evaluation (the full split, the configured
        beam); otherwise the cheap one run every ``train.eval_every`` steps.
        """
        raise NotImplementedError

    def summary_keys(self) -> Tuple[str, ...]:
        """The validation results the run's summary reports (as ``valid_<key>``)."""
        return ("loss", self.metric)

    def bar_value(self, loss: float) -> str:
        """The training loss as the progress bar shows it."""
        return f"{loss:.3f}"


def loss_sum(loss: torch.Tensor, n: int) -> torch.Tensor:
    """The sum of ``n`` losses whose mean is ``loss``, left on the device.

    float64, so that it equals ``loss.item() * n`` exactly (how the logged
    sums were taken before they stayed on the device); the trainer reads the
    sums only when it logs, saves or refreshes the progress bar.
    """
    return loss.detach().double() * n


class LMTask(Task):
    """Language modelling: bits per character or perplexity on a token stream."""

    name = "lm"
    carries_state = True

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        cfg = self.cfg
        self.corpus = load_corpus(cfg.data.corpus)
        if saved is not None:
            self.tokenizer = tokenizer_from_dict(saved["tokenizer.json"])
            check_tokenizer_fits(self.tokenizer, self.corpus.valid, cfg.data.max_oov,
                                 f"the validation split of {cfg.data.corpus}")
        else:
            self.tokenizer = build_tokenizer(cfg.data.tokenizer, self.corpus.train,
                                             **cfg.data.tokenizer_options())
        self.model_config = cfg.model_config(self.tokenizer.vocab_size)
        self.metric = metric_for(self.tokenizer)
        self.train_ids = self.tokenizer.encode(self.corpus.train)
        self.valid_ids = self.tokenizer.encode(self.corpus.valid)
        world = self.dist.world_size
        if cfg.train.batch_size % world:
            raise UserError(f"train.batch_size={cfg.train.batch_size} is the global number of "
                            f"streams and must be divisible by the {world} processes; choose "
                            f"a multiple of {world}")
        # the global streams, cut in W contiguous shares: the same streams as one process
        self.batcher = StreamBatcher(self.train_ids, cfg.train.batch_size // world,
                                     cfg.train.unroll, rank=self.dist.rank, world_size=world)

    def files(self) -> Dict[str, Any]:
        return {"tokenizer.json": self.tokenizer.to_dict()}

    def loss(self, model, batch, carried, device, precision):
        if batch.epoch_start:
            carried = None  # the streams start again from their beginning
        x, y = to_device(batch.inputs, device), to_device(batch.targets, device)
        with autocast_context(precision, device.type):
            out = model(x, carried, targets=y)
        n = y.numel()
        return out.loss, loss_sum(out.loss, n), n, n, out.state.detach()

    def validate(self, model, precision, *, final, max_batches):
        e = self.cfg.eval
        # the streams split across ranks when they divide; else every rank scores all
        dist = self.dist
        world = dist.world_size if e.batch_size % dist.world_size == 0 else 1
        res = evaluate(model, self.valid_ids, batch_size=e.batch_size // world,
                       unroll=e.unroll or self.cfg.train.unroll, mem_len=e.mem_len,
                       precision=precision, max_batches=max_batches,
                       rank=dist.rank if world > 1 else 0, world_size=world)
        if world > 1:
            total, count = dist.sum([res["loss"] * res["tokens"], res["tokens"]])
            loss = total / max(count, 1)
            res.update(loss=loss, bpc=loss / math.log(2), ppl=math.exp(min(loss, 700.0)),
                       tokens=int(count))
        out = {"bpc": res["bpc"]} if self.metric == "bpc" else {}
        out.update(ppl=res["ppl"], loss=res["loss"], tokens=res["tokens"])
        return out

    def summary_keys(self):
        return ("loss", "ppl", "bpc") if self.metric == "bpc" else ("loss", "ppl")

    def bar_value(self, loss: float) -> str:
        return (f"{loss / math.log(2):.3f}" if self.metric == "bpc"
                else f"{math.exp(min(loss, 700.0)):.1f}")


# --------------------------------------------------------------------------- sentence tasks

def encode_lines(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    """Each text's ids; word and subword tokenizers end each with ``<eos>``.

    Line tokenizers encode all texts in one call (a text holds no newline: a
    TSV field cannot) and the result is cut at ``<eos>``.
    """
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        return [tokenizer.encode(t).tolist() for t in texts]
    if not texts:
        return []
    # a final "\n" ends the last line without starting another: one line per text,
    # an empty last text included
    ids = tokenizer.encode("\n".join(texts) + "\n").tolist()
    out, start = [], 0
    for i, t in enumerate(ids):
        if t == eos:
            out.append(ids[start:i + 1])
            start = i + 1
    if len(out) != len(texts):  # a text held a newline after all
        raise ValueError("a text holds a line break; give one text per line")
    return out


def fit_length(seqs: List[List[int]], limit: int, *, truncate: bool, where: str,
               keep_last: bool = True) -> List[List[int]]:
    """Sequences longer than ``limit``: a ValueError, or cut (the count warned) when ``truncate``.

    A cut sequence keeps its last token (``<eos>``) when ``keep_last``.
    """
    long = [i for i, s in enumerate(seqs) if len(s) > limit]
    if not long:
        return seqs
    if not truncate:
        raise ValueError(f"{len(long)} sentence(s) of {where} are longer than "
                         f"data.max_len={limit} tokens (the first is number {long[0] + 1}, "
                         f"{len(seqs[long[0]])} tokens); raise data.max_len, or set "
                         f"data.truncate=true to cut them")
    warnings.warn(f"{len(long)} sentence(s) of {where} cut to data.max_len={limit} tokens",
                  stacklevel=2)
    cut = (lambda s: s[:limit - 1] + s[-1:]) if keep_last else (lambda s: s[:limit])
    return [cut(s) if len(s) > limit else s for s in seqs]


def length_batches(lengths: Sequence[int], max_tokens: int,
                   max_batches: Optional[int] = None) -> List[List[int]]:
    """Fixed batches of similar lengths, for evaluation and inference.

    With ``max_batches``, a fixed random choice of that many: the first
    batches in length order would hold only the shortest sentences.
    """
    if not lengths:
        return []
    batches = LengthBatcher(lengths, max_tokens, shuffle=False).batches()
    if max_batches is not None and max_batches < len(batches):
        chosen = sorted(random.Random(0).sample(range(len(batches)), max_batches))
        batches = [batches[i] for i in chosen]
    return batches


def content_crc32(seqs: Sequence[Sequence[int]]) -> int:
    """A checksum of the training items, so that a resumed run refuses other data."""
    crc = 0
    for s in seqs:
        crc = zlib.crc32(np.asarray(s, dtype=np.int64).tobytes(), crc)
    return crc


def pad_batch(seqs: Sequence[Sequence[int]], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, L) and their padding mask (B, L), True at padding."""
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, L, dtype=torch.long)
    pad = torch.ones(B, L, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        pad[b, :len(s)] = False
    return to_device(ids, device), to_device(pad, device)


class SentenceTask(Task):
    """Shared by translation and classification: a TSV table, sentences batched
    by length under ``train.max_tokens``, and the length limit ``data.max_len``."""

    weighted_accumulation = True

    def rank_share(self, indices: Sequence[int]) -> Tuple[List[int], bool]:
        """This rank's items of a global batch, and whether they count.

        A rank whose share is empty (a batch of fewer sentences than ranks)
        still runs a forward and backward, on the batch's first item with
        weight 0, so that every rank takes part in the gradient all-reduce.
        """
        mine = self.dist.share(indices)
        return (mine, True) if mine else (list(indices[:1]), False)

    def table_source(self) -> str:
        """data.corpus, which a sentence task cannot do without."""
        if self.cfg.data.corpus is None:
            raise UserError(f"task={self.name} needs data: give --data FILE.tsv "
                            f"(or data.corpus in the recipe)")
        return self.cfg.data.corpus

    def check_splits(self, splits) -> None:
        """Training and validation rows must exist before any training time is spent."""
        for name in ("train", "valid"):
            if not splits.split(name):
                raise UserError(f"the {name} split of {self.cfg.data.corpus} is empty; give "
                                f"more rows, or set data.valid_size (a TSV's splits default to "
                                f"min(1000, 5%) of its rows)")

    def fit_lengths(self, seqs: List[List[int]], where: str, keep_last: bool = True
                    ) -> List[List[int]]:
        d = self.cfg.data
        try:
            return fit_length(seqs, d.max_len, truncate=d.truncate, where=where,
                              keep_last=keep_last)
        except ValueError as e:
            raise UserError(str(e)) from None
