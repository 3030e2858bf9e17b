"""What each task supplies to the trainer, ``srupp eval``, ``srupp compare`` and the config.

A task owns its data, tokenizer (and labels), batches, loss and evaluation;
the trainer owns everything else: the optimiser and schedule, the time
budget, precision, checkpoints and exact resume, progress, metrics and
curves. Three tasks, chosen by the recipe's top-level ``task`` key (the
registry is :data:`srupp.train.config.TASKS`):

    lm         language modelling (this module): streams of tokens, state carried
    translate  :mod:`srupp.train.translate`: sentence pairs, BLEU
    classify   :mod:`srupp.train.classify`: labelled texts, accuracy and macro-F1

Everything that differs between tasks is a class attribute or method here,
so nothing outside the task modules asks which task a run is.
"""

from __future__ import annotations

import math
import statistics
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..data import StreamBatcher, build_tokenizer, load_corpus, tokenizer_from_dict
from ..errors import UserError, user_input
from ..inference import fit_length
from .device import to_device
from .distributed import SINGLE, Dist
from .evaluate import autocast_context, evaluate, metric_for

if TYPE_CHECKING:
    from .config import RunConfig

# srupp compare's speed measurements: the median of this many timed runs
SPEED_REPEATS = 3


def check_tokenizer_fits(tokenizer, text: str, max_oov: float, where: str) -> float:
    rate = tokenizer.oov_rate(text)
    if rate > max_oov:
        raise UserError(
            f"the saved {tokenizer.to_dict()['type']} tokenizer does not fit {where}: "
            f"{rate:.1%} of it is out of vocabulary (data.max_oov={max_oov:.1%}); "
            f"use the data the run was trained on, or raise data.max_oov")
    return rate


def median_rate(work: Callable[[], int], device, repeats: int = SPEED_REPEATS) -> float:
    """Items per second of ``work()`` (which returns how many it did): the median
    of ``repeats`` timed runs after one untimed warm-up, without gradients.

    One run of a quarter-second is at the mercy of one scheduler hiccup, and
    the first warms caches and allocators.
    """
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    speeds = []
    with torch.no_grad():
        for i in range(repeats + 1):
            sync()
            start = time.perf_counter()
            done = work()
            sync()
            if i:
                speeds.append(done / max(time.perf_counter() - start, 1e-9))
    return statistics.median(speeds)


class Task:
    """The interface of a task.

    For the trainer, after :meth:`load`: ``model_config`` (the model to
    build), ``batcher`` (``iter_from(position)``, ``position``,
    ``state_dict()``, ``load_state_dict()``), ``metric`` (the main validation
    metric's name) and ``higher_is_better`` (for that metric).
    """

    name = ""
    title = ""      # what its runs and models are called in messages
    command = ""    # the srupp command that applies its models to new text
    # the files saved with the run and with every checkpoint, beside the model
    file_names: Tuple[str, ...] = ("tokenizer.json",)
    metric = "loss"
    higher_is_better = False
    carries_state = False  # the LM carries its recurrent state from batch to batch
    weighted_accumulation = False  # micro-batches differ in size: weight them by their count

    # config defaults where the recipe leaves data.* unset
    default_tokenizer = "byte"
    default_corpus: Optional[str] = None
    default_subword_type: Optional[str] = None

    # srupp compare: name -> (model.type, fixed depth or None for the recipe's, extra fields)
    compare_models: Dict[str, tuple] = {}
    default_compare_models: Tuple[str, ...] = ()
    depth_fields: Tuple[str, ...] = ("num_layers",)  # the fields a fixed depth sets
    # results.md's columns between "final" and "lr"
    compare_columns: Tuple[str, ...] = ("time_to_best_baseline", "time_to_transformer_final")
    # without a recipe, compare starts from the packaged recipes and tuned learning rates
    packaged_compare_defaults = False

    def __init__(self, cfg: "RunConfig", dist: Dist = SINGLE):
        self.cfg = cfg
        self.dist = dist  # under torchrun: this rank's share of the batches and of evaluation

    # ---------------------------------------------------------------- config

    @classmethod
    def check_config(cls, cfg: "RunConfig") -> None:
        """UserError for settings this task cannot train with (after the defaults are set)."""

    @classmethod
    def model_fields(cls, cfg: "RunConfig", num_labels: Optional[int]) -> Dict[str, Any]:
        """The model config fields the task sets, beside the recipe's and the vocabulary."""
        return {"task": cls.name}

    @classmethod
    def output_labels(cls, cfg: "RunConfig") -> Optional[int]:
        """The number of labels its model predicts, counted without training (None: no labels)."""
        return None

    # ---------------------------------------------------------------- training

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        """Read the data and build the tokenizer, or take it from ``saved`` (a resumed
        run's files)."""
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

    # ---------------------------------------------------------------- srupp eval

    def evaluate_checkpoint(self, model, tokenizer, ckpt: Path, split: str) -> Dict[str, Any]:
        """``srupp eval``: the scores of a saved model on ``split`` of ``cfg.data.corpus``."""
        raise NotImplementedError

    # ---------------------------------------------------------------- srupp compare

    def compare_results(self, result: Dict[str, Any], step: int,
                        tokens_seen: int) -> Dict[str, Any]:
        """A trained model's ``tokens`` and validation results for compare's summary.

        ``result`` is the trainer's summary; sentences vary in length, so the
        sentence tasks count what training read (targets; texts).
        """
        return {"tokens": tokens_seen,
                **{k: v for k, v in result.items() if k.startswith("valid_")}}

    def speed(self, model, device, precision: str,
              repeats: int = SPEED_REPEATS) -> Dict[str, float]:
        """compare's inference speed columns for a trained ``model`` (after :meth:`load`)."""
        raise NotImplementedError

    @classmethod
    def compare_note(cls, metric: str, cfg: Optional["RunConfig"]) -> str:
        """results.md's first line: the metric, which way is better, how it was measured."""
        raise NotImplementedError


def time_to_note(higher_is_better: bool) -> str:
    """What results.md's time_to_* columns mean."""
    reached = "first reached (>=)" if higher_is_better else "first reached (<=)"
    return (f"the time_to_* columns are the training seconds at which a model's validation "
            f"curve {reached} the best baseline's (or the Transformer's) final value.")


def loss_sum(loss: torch.Tensor, n: int) -> torch.Tensor:
    """The sum of ``n`` losses whose mean is ``loss``, left on the device.

    float64, so that it equals ``loss.item() * n`` exactly (how the logged
    sums were taken before they stayed on the device); the trainer reads the
    sums only when it logs, saves or refreshes the progress bar.
    """
    return loss.detach().double() * n


# --------------------------------------------------------------------------- language modelling

PROMPT_TOKENS = 64   # compare's generation speed: a validation prompt of this many tokens
NEW_TOKENS = 256     # ... then this many new tokens at batch 1


class LMTask(Task):
    """Language modelling: bits per character or perplexity on a token stream."""

    name = "lm"
    title = "language-model"
    command = "generate"
    carries_state = True
    default_corpus = "shakespeare"
    compare_models = {
        "srupp": ("srupp", None, {}),
        "sru": ("sru", 4, {}),
        "lstm": ("lstm", 2, {}),
        "gru": ("gru", 2, {}),
        # no segment memory: each window stands alone with learned positions
        # (GPT-style), as with memory its absolute positions never repeat
        # (docs/results.md compares the two). max_positions covers the training
        # window and the generation test (PROMPT_TOKENS + NEW_TOKENS) without
        # spending parameters on positions that are never used.
        "transformer": ("transformer", 4, {"mem_len": 0, "max_positions": 512}),
        "srupp-attn-every-2": ("srupp", None, {"attention_every_n_layers": 2}),
        "srupp-attn-last-1": ("srupp", None, {"attention_last_n_layers": 1}),
    }
    default_compare_models = ("srupp", "sru", "lstm", "gru", "transformer")
    compare_columns = (*Task.compare_columns, "generate_tokens_per_s")
    packaged_compare_defaults = True

    @classmethod
    def model_fields(cls, cfg, num_labels):
        # the attention window defaults to one training segment
        return {"mem_len": cfg.train.unroll} if cfg.model.get("mem_len") is None else {}

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        cfg = self.cfg
        with user_input():
            self.corpus = load_corpus(cfg.data.corpus)
        if saved is not None:
            with user_input():
                self.tokenizer = tokenizer_from_dict(saved["tokenizer.json"])
            check_tokenizer_fits(self.tokenizer, self.corpus.valid, cfg.data.max_oov,
                                 f"the validation split of {cfg.data.corpus}")
        else:
            with user_input():
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

    def evaluate_checkpoint(self, model, tokenizer, ckpt, split):
        cfg = self.cfg
        with user_input():
            text = load_corpus(cfg.data.corpus).split(split)
        oov = check_tokenizer_fits(tokenizer, text, cfg.data.max_oov, f"the {split} split")
        res = evaluate(model, tokenizer.encode(text), batch_size=cfg.eval.batch_size,
                       unroll=cfg.eval.unroll or cfg.train.unroll, mem_len=cfg.eval.mem_len,
                       precision="fp32")
        metric = metric_for(tokenizer)  # bits per character, or perplexity per token
        return {metric: res[metric], "loss": res["loss"], "tokens": res["tokens"],
                "seconds": res["seconds"], "oov_rate": oov}

    def compare_results(self, result, step, tokens_seen):
        t = self.cfg.train
        return {"tokens": step * t.batch_size * t.unroll * t.grad_accum,
                # valid_ppl always; valid_bpc only for byte and char tokenizers
                **{k: result[k] for k in ("valid_bpc", "valid_ppl") if k in result}}

    def speed(self, model, device, precision, repeats=SPEED_REPEATS):
        """Tokens/s decoding NEW_TOKENS at batch 1 after a PROMPT_TOKENS validation prompt."""
        model.eval()
        prompt = (self.valid_ids[:PROMPT_TOKENS].tolist()
                  or self.train_ids[:PROMPT_TOKENS].tolist())

        def work() -> int:
            gen = torch.Generator(device=device).manual_seed(0)
            return len(model.generate([prompt], NEW_TOKENS, temperature=1.0, generator=gen)[0])

        return {"generate_tokens_per_s": median_rate(work, device, repeats)}

    @classmethod
    def compare_note(cls, metric, cfg):
        return f"Validation metric: **{metric}** (lower is better); {time_to_note(False)}"


# --------------------------------------------------------------------------- sentence tasks

def content_crc32(seqs: Sequence[Sequence[int]]) -> int:
    """A checksum of the training items, so that a resumed run refuses other data."""
    crc = 0
    for s in seqs:
        crc = zlib.crc32(np.asarray(s, dtype=np.int64).tobytes(), crc)
    return crc


class SentenceTask(Task):
    """Shared by translation and classification: a TSV table, sentences batched
    by length under ``train.max_tokens``, and the length limit ``data.max_len``."""

    weighted_accumulation = True
    default_subword_type = "bpe"  # the usual subwords of translation
    # SRU++ and the Transformer keep the recipe's depth; the recurrent baselines
    # their classic depth: 2 layers (2 + 2 when translating, Luong et al. 2015
    # style; bidirectional when classifying). There is no GRU for these tasks.
    compare_models = {
        "srupp": ("srupp", None, {}),
        "sru": ("sru", 2, {}),
        "lstm": ("lstm", 2, {}),
        "transformer": ("transformer", None, {}),
    }
    default_compare_models = tuple(compare_models)

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
        with user_input():
            return fit_length(seqs, d.max_len, truncate=d.truncate, where=where,
                              keep_last=keep_last)
