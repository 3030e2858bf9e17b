"""The run configuration as plain dataclasses: ``[data]``, ``[train]``, ``[eval]``, the
``[model]`` fields, and the task's name.

Each section checks its own fields when built (:meth:`DataConfig.check` and the
others' ``__post_init__``): every number against the section's ``_ranges`` (the
model's are its config's, :mod:`srupp.models.config`), a float must be finite (nan,
inf and -inf never pass), and an error names the key, the value and the range
(:mod:`srupp._ranges`). Nothing here knows the tasks:
:func:`srupp.train.config.build_config` reads a recipe, applies the task's defaults
and checks, and sets :attr:`RunConfig.task_class`.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, get_type_hints

import torch

from .._ranges import check, check_fields
from ..data import SentencePieceTokenizer
from ..errors import UserError
from ..models import BACKBONES, config_from_dict
from ..models.registry import REGISTRY

def _check_numbers(section: str, cfg: Any) -> None:
    """UserError for the first number of ``cfg`` (a section's dataclass) that is not
    finite or not in its range (the class's ``_ranges``), named ``section.key``."""
    check_fields(cfg, prefix=f"{section}.", error=UserError)


# train.optimizer's choices (the trainer's build_optimizer builds each), by their torch class
OPTIMIZERS = {"radam": torch.optim.RAdam, "adamw": torch.optim.AdamW}

# train.optimizer_impl: torch's kernels for the update. "fused": one kernel for all tensors
# (where torch has one: AdamW, not RAdam); "foreach": a few kernels per op over tensor lists
# (torch's default on CUDA); "loop": tensor by tensor (torch's default on the CPU); "auto":
# fused on CUDA where torch has it, else foreach on CUDA, torch's default on the CPU
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "loop")

# train.compile: "off"; "model": torch.compile of the whole training forward; "layers": each
# repeated layer of the backbone compiled alone (regional compilation); "layers-cudagraphs":
# the same with CUDA graphs (mode="reduce-overhead"), CUDA only. Runs saved before the choice
# say true or false: true was "model".
COMPILE_MODES = ("off", "model", "layers", "layers-cudagraphs")
_COMPILE_BOOLS = {"true": "model", "1": "model", "yes": "model",
                  "false": "off", "0": "off", "no": "off"}


def _one_of(choices) -> str:
    """'a, b or c'."""
    return f"{', '.join(choices[:-1])} or {choices[-1]}"


def has_fused(optimizer: str) -> bool:
    """Whether torch has a fused implementation of ``train.optimizer`` (its ``fused`` flag)."""
    return "fused" in inspect.signature(OPTIMIZERS[optimizer]).parameters


@dataclass
class DataConfig:
    corpus: Optional[str] = None      # lm: a corpus name, text file or split dir; else a TSV or dir
    tokenizer: Optional[str] = None   # byte|char|word|sentencepiece, built from train (None: task's)
    max_oov: float = 0.01             # refuse data a saved tokenizer covers worse than this
    vocab_size: Optional[int] = None  # word/sentencepiece vocabulary cap; srupp params counts with it
    min_freq: int = 1                 # word level: rarer training words become <unk>
    lowercase: bool = False           # word level: fold case (PTB-style)
    subword_type: Optional[str] = None  # sentencepiece bpe|unigram (None: lm unigram, else bpe)
    byte_fallback: bool = True        # sentencepiece: unseen characters as UTF-8 byte pieces, never
                                      # <unk> (⁇ in output); the 256 pieces count in vocab_size
    src: str = "de"                   # translate: the source column of the TSV
    tgt: str = "en"                   # translate: the target column
    text: str = "text"                # classify: the text column
    label: str = "label"              # classify: the label column
    test_size: Optional[int] = None   # TSV rows held out for test (None: min(1000, 5%))
    valid_size: Optional[int] = None  # TSV rows held out for validation (None: min(1000, 5%))
    max_len: int = 256                # tokens per sentence (source, target or text) at most
    truncate: bool = False            # longer sentences: cut (with a count warned), not an error

    _ranges = {"max_oov": "[0, 1]", "vocab_size": ">= 1", "min_freq": ">= 1",
               "test_size": ">= 0", "valid_size": ">= 0", "max_len": ">= 1"}

    def tokenizer_options(self) -> dict:
        """Keyword options for ``build_tokenizer`` that apply to this tokenizer type."""
        opts = {} if self.vocab_size is None else {"vocab_size": self.vocab_size}
        if self.tokenizer == "sentencepiece" and self.subword_type not in (None, "unigram"):
            opts["model_type"] = self.subword_type
        if self.tokenizer == "sentencepiece":
            opts["byte_fallback"] = self.byte_fallback
        if self.tokenizer == "word":
            opts.update(min_freq=self.min_freq, lowercase=self.lowercase)
        return opts

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """UserError for a number out of its range, or for settings the tokenizer does not
        take. build_config checks again once the task's default tokenizer is set."""
        _check_numbers("data", self)
        if self.tokenizer is None:
            return  # the task's default, set by build_config
        if (self.min_freq != 1 or self.lowercase) and self.tokenizer != "word":
            raise UserError("data.min_freq and data.lowercase apply to the word tokenizer only; "
                            "unset them or use data.tokenizer=word")
        if self.subword_type not in (None, "bpe", "unigram"):
            raise UserError(f"data.subword_type must be bpe or unigram, "
                            f"got {self.subword_type!r}")
        if self.vocab_size is not None and self.tokenizer in ("byte", "char"):
            raise UserError(f"data.vocab_size applies to word and sentencepiece tokenizers, "
                            f"not {self.tokenizer!r} ones (their vocabulary is fixed by "
                            f"the data); unset it")
        if not self.byte_fallback and self.tokenizer != "sentencepiece":
            raise UserError("data.byte_fallback applies to the sentencepiece tokenizer only; "
                            "unset it")
        least = SentencePieceTokenizer.MIN_VOCAB_BYTE_FALLBACK
        if (self.tokenizer == "sentencepiece" and self.byte_fallback
                and self.vocab_size is not None and self.vocab_size < least):
            raise UserError(f"data.vocab_size={self.vocab_size} is too small for sentencepiece's "
                            f"byte fallback, whose 256 byte pieces count in it: use at least "
                            f"{least - 1} plus the number of distinct characters of the data, "
                            f"or set data.byte_fallback=false (unseen characters then come "
                            f"out as ⁇)")


@dataclass
class TrainConfig:
    max_steps: int = 10_000           # optimiser steps; the cosine ends here unless time ends first
    max_seconds: Optional[float] = None  # training-time budget (evaluation excluded)
    batch_size: int = 16              # lm: parallel streams B
    unroll: int = 256                 # lm: tokens per segment L (backprop through time)
    max_tokens: int = 4096            # translate/classify: padded tokens per batch (one side)
    label_smoothing: float = 0.1      # translate: ε of the label-smoothed loss
    lr: float = 2e-3                  # peak learning rate
    optimizer: str = "radam"          # radam (the SRU++ paper's) or adamw (GPT recipes')
    optimizer_impl: str = "auto"      # auto, fused, foreach or loop: torch's kernels for the
                                      # update (OPTIMIZER_IMPLS); the results agree to rounding
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # moments' decays β1, β2;
                                      # GPT recipes (nanoGPT) take 0.9, 0.95
    weight_decay: float = 0.1         # decoupled (AdamW-style) for both optimizers
    no_decay_bias_norm: bool = False  # exempt biases, norms, α and peepholes from decay
    warmup_steps: int = 200           # linear warm-up, then the decay
    warmup_fraction: Optional[float] = None  # warm-up as a share of the fitted schedule (budgets)
    schedule: str = "cosine"          # after warm-up: cosine to min_lr_ratio·lr, or inverse_sqrt
    min_lr_ratio: float = 0.0         # where the cosine ends
    grad_clip: float = 1.0            # max global gradient norm (0: off)
    grad_accum: int = 1               # consecutive segments per optimiser step
    precision: str = "fp32"           # "fp32", "bf16" (autocast) or "fp16" (CUDA, scaled)
    seed: int = 1234                  # model init, dropout and sampling
    log_every: int = 50               # steps between metrics lines; must divide save_every
    eval_every: int = 500             # steps between validation passes
    save_every: int = 500             # steps between checkpoints
    eval_max_batches: Optional[int] = None  # cap validation batches during training (None: all;
                                      # sentence tasks: a fixed random choice of length batches)
    calibration_steps: int = 20       # timed steps that fix the schedule length under max_seconds
    threads: Optional[int] = None     # torch intra-op threads (None: torch's default)
    device: str = "cpu"               # "cpu" or "cuda"
    compile: str = "off"              # torch.compile in training: off, model, layers or
                                      # layers-cudagraphs (COMPILE_MODES; true = model)
    dist_backend: str = "auto"        # torchrun: gloo on CPU, nccl on CUDA, or a backend name
    shard: str = "ddp"                # torchrun: "ddp" (replicas) or "fsdp" (FSDP2: sharded weights)
    dist_timeout: float = 300.0       # torchrun: seconds a collective waits for a rank that died
    tensorboard: bool = False         # metrics also as TensorBoard events (srupp[tensorboard])

    _ranges = {**dict.fromkeys(("max_steps", "batch_size", "unroll", "max_tokens", "grad_accum",
                                "log_every", "eval_every", "save_every", "eval_max_batches",
                                "calibration_steps", "threads"), ">= 1"),
               "max_seconds": "> 0", "label_smoothing": "[0, 1)", "lr": "> 0",
               "weight_decay": ">= 0", "warmup_steps": ">= 0", "warmup_fraction": "[0, 1)",
               "min_lr_ratio": "[0, 1]", "grad_clip": ">= 0", "seed": "[0, 2**63)",
               "dist_timeout": "> 0"}

    def __post_init__(self):
        _check_numbers("train", self)
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise UserError(f"train.precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.save_every % self.log_every:
            raise UserError(f"train.log_every ({self.log_every}) must divide "
                            f"train.save_every ({self.save_every})")
        if self.schedule not in ("cosine", "inverse_sqrt"):
            raise UserError(f"train.schedule must be cosine or inverse_sqrt, "
                            f"got {self.schedule!r}")
        if self.shard not in ("ddp", "fsdp"):
            raise UserError(f"train.shard must be ddp or fsdp, got {self.shard!r}")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"train.optimizer must be {' or '.join(OPTIMIZERS)}, "
                            f"got {self.optimizer!r}")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise UserError(f"train.optimizer_impl must be {_one_of(OPTIMIZER_IMPLS)}, "
                            f"got {self.optimizer_impl!r}")
        if self.optimizer_impl == "fused" and not has_fused(self.optimizer):
            raise UserError(f"train.optimizer_impl=fused: torch {torch.__version__} has no fused "
                            f"{OPTIMIZERS[self.optimizer].__name__}; use train.optimizer_impl="
                            f"foreach (or auto), or train.optimizer=adamw")
        self.compile = _COMPILE_BOOLS.get(str(self.compile).lower(), self.compile)
        if self.compile not in COMPILE_MODES:
            raise UserError(f"train.compile must be {_one_of(COMPILE_MODES)} (true and false "
                            f"read as model and off), got {self.compile!r}")
        if self.compile == "layers-cudagraphs" and self.device != "cuda":
            raise UserError(f"train.compile=layers-cudagraphs records CUDA graphs: it needs "
                            f"train.device=cuda, got train.device={self.device}; on the CPU "
                            f"use train.compile=layers")
        if len(self.betas) != 2:
            raise UserError(f"train.betas must be two numbers (β1, β2), e.g. "
                            f"train.betas=0.9,0.95; got {self.betas!r}")
        for i, beta in enumerate(self.betas):
            check(f"train.betas[{i}]", beta, "[0, 1)", error=UserError)



@dataclass
class EvalConfig:
    unroll: Optional[int] = None      # segment length for evaluation (None: train.unroll)
    mem_len: Optional[int] = None     # attention window for evaluation (None: model.mem_len)
    batch_size: int = 16              # lm: streams; 1 evaluates every token with full context
    beam: int = 5                     # translate: beam size of the final evaluation
    lenpen: float = 1.0               # translate: length penalty (score / length**lenpen)
    max_len_a: float = 1.2            # translate: hypotheses end by a·source length + b tokens
    max_len_b: int = 10
    no_repeat_ngram_size: int = 0     # translate: n > 0 bans repeating an output n-gram (0: off)
    bleu_sentences: int = 200         # translate: greedy BLEU on this many during training

    _ranges = {"unroll": ">= 1", "mem_len": ">= 0", "batch_size": ">= 1", "beam": ">= 1",
               "lenpen": ">= 0", "max_len_a": ">= 0", "max_len_b": ">= 0",
               "no_repeat_ngram_size": ">= 0", "bleu_sentences": ">= 1"}

    def __post_init__(self):
        _check_numbers("eval", self)


@dataclass
class RunConfig:
    model: Dict[str, Any] = field(default_factory=dict)  # model.type's fields (vocab_size: data's)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    task: str = "lm"                  # lm, translate or classify: what the run trains
    # the Task subclass that ``task`` names (srupp.train.registry.TASKS), set where the
    # config is built (build_config); not saved (to_dict saves the name)
    task_class: Optional[type] = field(default=None, repr=False, compare=False)

    def model_config(self, vocab_size: int, num_labels: Optional[int] = None):
        """The model's config for this run: the recipe's fields, the vocabulary, and
        what the task sets (a language model's window, a classifier's labels)."""
        if self.task_class is None:
            raise TypeError(f"this RunConfig (task={self.task!r}) has no task_class: build it "
                            f"with srupp.train.build_config, or pass "
                            f"task_class=srupp.train.TASKS[{self.task!r}]")
        cfg = {**self.model, "vocab_size": vocab_size,
               **self.task_class.model_fields(self, num_labels)}
        return _model_config(cfg)

    def to_dict(self) -> Dict[str, Any]:
        """The config as build_config(base=...) reads it."""
        d = asdict(self)
        del d["task_class"]
        return d



SECTIONS = ("data", "train", "eval", "model")


class _Types(dict):
    """{key: type} of each section; "model": the fields of every task's model types' configs,
    read when asked (a backbone may be registered after this import)."""

    def __missing__(self, section: str) -> Dict[str, Any]:
        if section != "model":
            raise KeyError(section)
        return _model_types(tuple(BACKBONES.items()))


@functools.lru_cache(maxsize=4)
def _model_types(backbones: tuple) -> Dict[str, Any]:
    return {**{k: t for models in REGISTRY.values() for config_class, _ in models.values()
               for k, t in get_type_hints(config_class).items()
               if k not in ("task", "type", "num_labels")}, "type": str}


TYPES = _Types(data=get_type_hints(DataConfig), train=get_type_hints(TrainConfig),
               eval=get_type_hints(EvalConfig))


def _model_config(d: Dict[str, Any]):
    """config_from_dict, with its errors in config keys (num_heads -> model.num_heads)."""
    try:
        return config_from_dict(d)
    except (ValueError, TypeError) as e:
        names = "|".join(sorted(TYPES["model"], key=len, reverse=True))
        raise UserError(re.sub(rf"(?<![\w.'])({names})\b", r"model.\1", str(e))) from None
