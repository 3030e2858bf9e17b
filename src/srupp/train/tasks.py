"""What each task supplies to the trainer, ``srupp eval``, ``srupp compare`` and the config.

A task owns its data, tokenizer (and labels), batches, loss and evaluation;
the trainer owns everything else: the optimiser and schedule, the time
budget, precision, checkpoints and exact resume, progress, metrics and
curves. Three tasks, chosen by the recipe's top-level ``task`` key (the
registry is :data:`srupp.train.registry.TASKS`):

    lm         :mod:`srupp.train.lm`: streams of tokens, state carried
    translate  :mod:`srupp.train.translate`: sentence pairs, BLEU
    classify   :mod:`srupp.train.classify`: labelled texts, accuracy and macro-F1

Everything that differs between tasks is a class attribute or method here,
so nothing outside the task modules asks which task a run is.
"""

from __future__ import annotations

import statistics
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import UserError, user_input
from ..inference import fit_length
from ..runs import TOKENIZER
from .distributed import SINGLE, Dist

if TYPE_CHECKING:
    from .run_config import RunConfig

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
    file_names: Tuple[str, ...] = (TOKENIZER,)
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

    def bar_value(self, loss: float) -> Dict[str, str]:
        """What the progress bar shows beside the training loss ({name: value})."""
        return {}

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

    float64, so that it equals ``loss.item() * n`` exactly; the trainer reads
    the sums only when it logs, saves or refreshes the progress bar.
    """
    return loss.detach().double() * n


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
    # style; bidirectional when classifying). The GRU trains for these tasks too
    # (model.type=gru), but is no compare baseline here: the LSTM stands for the
    # gated RNNs, and each extra model costs a whole --budget.
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
