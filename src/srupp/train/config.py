"""Run configuration: a TOML recipe plus ``--set key=value`` overrides.

A recipe has one top-level key, ``task`` ("lm", the default, "translate" or
"classify"; ``--set task=translate``), and four tables, ``[model]``,
``[data]``, ``[train]`` and ``[eval]``; every key is optional. Each field
below says why it exists; the ``[model]`` keys are the fields of the config
of the task's ``model.type`` (:mod:`srupp.models`), and a key of another
model type is an error. Some keys apply to some tasks only: the LM's stream
layout (``train.batch_size``, ``train.unroll``), the sentence tasks' columns
and token batches (``data.src``, ``train.max_tokens``, ...).

Every number is checked when read: each section's ``_ranges`` gives its keys'
ranges (the model's are its config's, :mod:`srupp.models.config`), and a float
must be finite (nan, inf and -inf never pass); an error names the key, the
value and the range (:mod:`srupp._ranges`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import (Any, Dict, List, Optional, Type, Union, get_args, get_origin,
                    get_type_hints)

import torch

from .._ranges import check, check_fields
from ..data import SentencePieceTokenizer
from ..errors import UserError
from ..models import BACKBONES, config_from_dict
from ..models.registry import REGISTRY
from .classify import ClassificationTask
from .lm import LMTask
from .tasks import Task
from .translate import TranslationTask

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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


# The tasks a run can train, by the recipe's ``task`` key (srupp.train.tasks)
TASKS: Dict[str, Type[Task]] = {t.name: t for t in (LMTask, TranslationTask, ClassificationTask)}


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
        _check_numbers("data", self)
        if self.tokenizer is None:
            return  # the task's default: RunConfig resolves it and checks again
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

    def __post_init__(self):
        task = self.task_class  # an unknown task: its error
        d = self.data
        if d.tokenizer is None:
            d.tokenizer = task.default_tokenizer
        if d.subword_type is None:
            d.subword_type = task.default_subword_type
        if d.corpus is None:
            d.corpus = task.default_corpus  # classify has none: its task asks for --data
        task.check_config(self)
        DataConfig.__post_init__(d)  # checks that need the resolved tokenizer

    @property
    def task_class(self) -> Type[Task]:
        """The :class:`~srupp.train.tasks.Task` that ``task`` names."""
        if self.task not in TASKS:
            raise UserError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        return TASKS[self.task]

    def model_config(self, vocab_size: int, num_labels: Optional[int] = None):
        """The model's config for this run: the recipe's fields, the vocabulary, and
        what the task sets (a language model's window, a classifier's labels)."""
        cfg = {**self.model, "vocab_size": vocab_size,
               **self.task_class.model_fields(self, num_labels)}
        return _model_config(cfg)

    def to_dict(self) -> Dict[str, Any]:
        """The config as build_config(base=...) reads it."""
        return asdict(self)


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


def _unknown(key: str) -> UserError:
    known = [f"{s}.{k}" for s in SECTIONS for k in TYPES[s]]
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return UserError(f"unknown config key {key!r}{hint}")


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _coerce(key: str, value: Any, typ) -> Any:
    """Convert a TOML or command-line value to the field's type.

    Lists (``List[int]``) come as TOML arrays, or on the command line as
    comma-separated values: ``--set model.adaptive_cutoffs=19997,39997,199997``
    (brackets allowed).
    """
    if get_origin(typ) is Union:  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        typ = next(a for a in get_args(typ) if a is not type(None))
    if get_origin(typ) in (list, List):
        (item,) = get_args(typ) or (Any,)
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key} must be a list, e.g. {key}=1,2,3; got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    try:
        if typ is bool:
            return value if isinstance(value, bool) else _BOOLS[str(value).lower()]
        if typ is int:
            if isinstance(value, (str, float)) and not math.isfinite(float(value)):
                return float(value)  # nan, inf: the section's check names the key's range
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if typ in (float, str):
            return typ(value)
    except (TypeError, ValueError, KeyError):
        raise UserError(f"{key} must be {typ.__name__}, got {value!r}") from None
    return value


def _probe_vocab(tree: Dict[str, Dict[str, Any]]) -> int:
    """A vocabulary size to validate the model fields with before any data is read."""
    vocab = tree["data"].get("vocab_size")
    if isinstance(vocab, int) and vocab >= 1:  # else data's own check names data.vocab_size
        return vocab
    cutoffs = tree["model"].get("adaptive_cutoffs")
    if isinstance(cutoffs, list) and cutoffs and all(isinstance(c, int) for c in cutoffs):
        return max(256, max(cutoffs) + 1)
    return 256


def drop_other_types_keys(model: Dict[str, Any], task: str,
                          keep: frozenset = frozenset()) -> None:
    """Drop model keys that do not apply to model.type, except those in ``keep``.

    For a recipe's keys once the type changed (``--set model.type=...``, or
    one of ``srupp compare``'s models): an SRU++ recipe's proj_size means
    nothing to an LSTM. Keys left in ``keep`` (given with ``--set``) are
    errors (config_from_dict's).
    """
    mtype, models = model.get("type", "srupp"), REGISTRY.get(task, {})
    if mtype in models:
        own = {f.name for f in fields(models[mtype][0])} | {"type"}
        for key in set(model) & set(TYPES["model"]) - own - keep:
            del model[key]


def _other_task(run: str, have: str, want: str, source: str, implicit: bool) -> UserError:
    """The error for a saved run of task ``have`` given a recipe or --set of task ``want``."""
    if source.startswith("recipe"):
        asks = (f"{source} is a {TASKS[want].title} recipe (task={want}"
                f"{', as it names no task' if implicit else ''})")
        fix = "resume with the run's own recipe"
    else:
        asks = f"{source} asks for a {TASKS[want].title} run"
        fix = f"drop {source} to resume"
    return UserError(f"{run} is a {TASKS[have].title} run (task={have}); {asks}: "
                     f"{fix}, or train into a new --out")


def build_config(recipe: Optional[Union[str, Path]] = None,
                 overrides: Optional[List[str]] = None,
                 base: Optional[Dict[str, Any]] = None,
                 base_name: str = "the saved run") -> RunConfig:
    """Read a recipe, apply ``key=value`` overrides and validate everything.

    Args:
        recipe: a TOML file, or None for the defaults.
        overrides: strings ``"section.key=value"``, or ``"task=translate"``.
        base: a dict in the shape of :meth:`RunConfig.to_dict` to start from
            (a saved run's config) instead of the defaults.
        base_name: what the messages call ``base`` (the run's directory).

    With ``base``, a recipe (one without a ``task`` key is a language-model
    recipe) or a ``--set task=...`` of another task than the run's is an error
    that names both tasks, before any of their keys is read.
    """
    tree: Dict[str, Dict[str, Any]] = {s: {} for s in SECTIONS}
    task = "lm"
    base_task = None
    asked = None  # (task, where it was asked for, implicit): the recipe's or --set's
    if base:
        base = dict(base)
        if "task" not in base:  # every saved config names its task
            raise UserError(f"{base_name}'s config.json is corrupt (it names no task); "
                            f"the run is damaged")
        task = base_task = base.pop("task")
        for s, vals in base.items():
            if s not in SECTIONS:
                raise _unknown(s)
            tree[s].update(vals)
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise UserError(f"recipe {str(path)!r} not found")
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"recipe {path} is not valid TOML: {e}") from None
        implicit = "task" not in data
        task = data.pop("task", "lm")  # a recipe that names no task is a language model's
        if not isinstance(task, str):
            raise UserError(f"recipe {path}: task must be a string "
                            f"({', '.join(TASKS)}), got {task!r}")
        asked = (task, f"recipe {path}", implicit)
        for s, vals in data.items():
            if s not in SECTIONS or not isinstance(vals, dict):
                raise UserError(f"recipe {path}: unknown section [{s}]; "
                                f"sections are {sorted(SECTIONS)}")
            tree[s].update(vals)
    set_model_keys = set()
    for item in overrides or []:
        if "=" not in item:
            raise UserError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip()
        if key == "task":
            task = value.strip()
            asked = (task, f"--set task={task}", False)
            continue
        if key.count(".") != 1 or key.split(".")[0] not in SECTIONS:
            raise _unknown(key)
        s, name = key.split(".")
        tree[s][name] = value
        if s == "model":
            set_model_keys.add(name)
    if "type" in set_model_keys:
        # --set model.type=lstm on an SRU++ recipe: the recipe's SRU++-only keys
        # no longer apply; keys given with --set still must
        drop_other_types_keys(tree["model"], task, keep=frozenset(set_model_keys))
    if task not in TASKS:
        raise UserError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if asked is not None and base_task is not None and asked[0] != base_task:
        raise _other_task(base_name, base_task, *asked)
    for s in SECTIONS:
        for name, value in list(tree[s].items()):
            if name not in TYPES[s]:
                raise _unknown(f"{s}.{name}")
            tree[s][name] = _coerce(f"{s}.{name}", value, TYPES[s][name])
    tree["model"].pop("vocab_size", None)  # always taken from the tokenizer
    cfg = RunConfig(model=tree["model"], data=DataConfig(**tree["data"]),
                    train=TrainConfig(**tree["train"]), eval=EvalConfig(**tree["eval"]),
                    task=task)
    # validate the model fields now; the vocabulary is only known once the tokenizer is
    # built, so vocabulary-dependent checks use data.vocab_size, or else just pass
    cfg.model_config(_probe_vocab(tree))
    return cfg
