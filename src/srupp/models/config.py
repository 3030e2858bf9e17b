"""Model configs: one base, the fields of each task, and a task × backbone config per type.

The config of (task, type) is composed here from the task's base
(:class:`LMConfig`, :class:`Seq2SeqConfig`, :class:`ClassifierConfig`) and the
backbone's fields (:mod:`srupp.models.backbones`): ``SRUppConfig`` is the
language-model config of type "srupp", ``SRUppClassifierConfig`` and
``SRUppSeq2SeqConfig`` its classifier and translation configs. Defaults give a
small model. Bad values raise ValueError naming the field: each class's
``_ranges`` gives its numbers' ranges (:func:`srupp._ranges.check_fields`
checks them, and that every float is finite, before anything else); then each
class of the config that defines ``check`` runs it, bases first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Dict, List, Optional

from .._ranges import check_fields
from ..nn.adaptive import check_cutoffs
from .backbones import BACKBONES, TASK_ROLES

TASK_NAMES = tuple(TASK_ROLES)  # "lm", "translate", "classify"


@dataclass
class ModelConfig:
    """What every config does: validation and (de)serialisation. Not built directly."""

    task: ClassVar[str] = ""              # what the model does (TASK_NAMES)
    type: ClassVar[str] = ""              # the backbone (srupp.models.backbones.BACKBONES)
    suffix: ClassVar[str] = ""            # of the config class names: SRUpp + suffix + Config

    def __post_init__(self):
        if not self.type:
            raise TypeError(f"{type(self).__name__} holds the fields every {self.task} model "
                            f"shares; build the config of a model type, or use "
                            f"config_from_dict({{'task': {self.task!r}, 'type': ...}})")
        check_fields(self)  # every number of every class of the config
        for klass in reversed(type(self).__mro__):
            if "check" in vars(klass):
                vars(klass)["check"](self)

    def to_dict(self) -> dict:
        """The fields, ``task`` and ``type``: what :func:`config_from_dict` reads back."""
        return {"task": self.task, "type": self.type, **asdict(self)}


def check_even_width(config) -> None:
    """A bidirectional encoder gives each direction d_model/2 units."""
    if getattr(config, "bidirectional", False) and config.d_model % 2:
        raise ValueError(f"d_model must be even: the bidirectional encoder gives each "
                         f"direction d_model/2 units; got {config.d_model}")


@dataclass
class LMConfig(ModelConfig):
    """What every language model shares: vocabulary, width, depth, dropout, memory, embeddings."""

    task: ClassVar[str] = "lm"

    vocab_size: int = 256                 # V; 256 for byte-level text
    d_model: int = 256                    # d: embedding, hidden and output width
    num_layers: int = 4                   # the paper uses 10
    dropout: float = 0.1                  # inside the body (layers, highway, residual branches)
    emb_dropout: Optional[float] = None   # after the embedding, before the output; None = dropout
    mem_len: Optional[int] = None         # tokens of past segments attention sees; None: all
    tie_embeddings: bool = False          # share input and output embeddings (enwik8: untied)
    adaptive_cutoffs: Optional[List[int]] = None  # adaptive input/softmax clusters; None: plain
    div_val: int = 4                      # adaptive cluster i is emb_dim // div_val**i wide
    emb_dim: Optional[int] = None         # n_e, adaptive cluster 0's width; None: d_model
    tie_projections: bool = True          # with tie_embeddings, share the cluster projections too

    _ranges = {"vocab_size": ">= 1", "d_model": ">= 1", "num_layers": ">= 1",
               "dropout": "[0, 1)", "emb_dropout": "[0, 1)", "mem_len": ">= 0",
               "div_val": ">= 1", "emb_dim": ">= 1"}

    def check(self):
        if self.adaptive_cutoffs is None:
            if self.emb_dim is not None or self.div_val != 4:
                raise ValueError("emb_dim and div_val only apply to adaptive embeddings: "
                                 "set adaptive_cutoffs too, or leave them at their defaults")
            return
        self.adaptive_cutoffs = check_cutoffs(self.adaptive_cutoffs, self.vocab_size,
                                              where="adaptive_cutoffs")
        n_e, last = self.emb_dim or self.d_model, len(self.adaptive_cutoffs)
        if n_e // self.div_val ** last < 1:
            raise ValueError(f"emb_dim ({n_e}) // div_val**{last} is 0: the last cluster would "
                             f"have no width; raise emb_dim or lower div_val")


@dataclass
class Seq2SeqConfig(ModelConfig):
    """What every translation model shares: one joint vocabulary, encoder and decoder depth."""

    task: ClassVar[str] = "translate"
    suffix: ClassVar[str] = "Seq2Seq"

    vocab_size: int = 8000                # V: one joint source/target vocabulary
    d_model: int = 256                    # d: embedding, hidden and output width
    encoder_layers: int = 4               # depth of the encoder
    decoder_layers: int = 4               # depth of the decoder
    dropout: float = 0.1                  # inside the layers and after the embedding
    tie_embeddings: bool = True           # one matrix for source, target and output (joint BPE)
    bos_id: int = 1                       # the decoder's first input (the tokenizer's <eos>)
    eos_id: int = 1                       # ends a target

    _ranges = {"vocab_size": ">= 1", "d_model": ">= 1", "encoder_layers": ">= 1",
               "decoder_layers": ">= 1", "dropout": "[0, 1)"}

    def check(self):
        for name in ("bos_id", "eos_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"{name} must be a token id below vocab_size "
                                 f"({self.vocab_size}), got {getattr(self, name)}")
        check_even_width(self)


POOLINGS = ("mean", "max", "attention")


@dataclass
class ClassifierConfig(ModelConfig):
    """What every classifier shares: vocabulary, labels, width, depth, pooling."""

    task: ClassVar[str] = "classify"
    suffix: ClassVar[str] = "Classifier"

    vocab_size: int                       # V: the tokenizer's vocabulary (no sensible default)
    num_labels: int                       # C: the classes; >= 2 (a binary task has 2)
    d_model: int = 256                    # d: embedding and encoder output width
    num_layers: int = 2                   # encoder depth; classification needs little
    dropout: float = 0.1                  # after the embedding, inside the encoder, before the head
    pooling: str = "mean"                 # mean|max|attention over real positions

    _ranges = {"vocab_size": ">= 1", "d_model": ">= 1", "num_layers": ">= 1",
               "dropout": "[0, 1)"}  # num_labels: below, with its note

    def check(self):
        if self.num_labels < 2:
            raise ValueError(f"num_labels must be >= 2 (a yes/no task has 2), "
                             f"got {self.num_labels}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be 'mean', 'max' or 'attention', "
                             f"got {self.pooling!r}")
        check_even_width(self)


TASK_CONFIGS = {"lm": LMConfig, "translate": Seq2SeqConfig, "classify": ClassifierConfig}
_COMPOSED: Dict[tuple, type] = {}


def task_types(task: str) -> List[str]:
    """The backbones that serve ``task`` (every role it needs), in registry order."""
    if task not in TASK_ROLES:
        raise ValueError(f"task must be one of {', '.join(TASK_NAMES)}; got {task!r}")
    return [t for t, b in BACKBONES.items() if set(TASK_ROLES[task]) <= set(b.roles)]


def config_class(task: str, model_type: str) -> type:
    """The config class of ``model_type`` for ``task``: the task's base and the backbone's fields.

    Composed once per (task, type) and kept, so that two configs of one type compare equal.
    """
    types = task_types(task)
    if model_type not in types:
        why = ""
        if model_type in BACKBONES:
            why = f" ({BACKBONES[model_type].__name__} has no {' or '.join(TASK_ROLES[task])} role)"
        raise ValueError(f"type must be one of {', '.join(types)} for task {task}; "
                         f"got {model_type!r}{why}")
    backbone = BACKBONES[model_type]
    key = (task, model_type, backbone)
    if key not in _COMPOSED:
        own = backbone.task_fields.get(task, backbone.fields)
        name = f"{backbone.label}{TASK_CONFIGS[task].suffix}Config"
        cls = type(name, (own, TASK_CONFIGS[task]),
                   {"type": model_type, "__module__": __name__, "__qualname__": name,
                    "__doc__": f"The {task} config of type {model_type!r}: "
                               f"{TASK_CONFIGS[task].__name__} and {own.__name__}."})
        _COMPOSED[key] = dataclass(cls)
    return _COMPOSED[key]


def _field_names(cls) -> set:
    return {f.name for f in fields(cls)}


def config_from_dict(d: Dict[str, Any]):
    """The config of ``d["task"]`` (default lm) and ``d["type"]`` (default srupp).

    The other entries are the config's fields. A key that another type of the
    same task reads is named as such; any other unknown key is an error too.
    """
    d = dict(d)
    task = d.pop("task", "lm")
    cls = config_class(task, d.pop("type", "srupp"))
    own = _field_names(cls)
    for key in sorted(set(d) - own):
        users = [t for t in task_types(task) if key in _field_names(config_class(task, t))]
        if users:
            raise ValueError(f"{key} applies to type={' or '.join(users)}, not {cls.type}")
        raise ValueError(f"unknown config key {key!r}; a {task} {cls.type} config has "
                         f"{', '.join(sorted(own))}")
    return cls(**d)


# The config classes by name, for users who build one directly (config_from_dict reads any).
SRUppConfig = config_class("lm", "srupp")
SRUConfig = config_class("lm", "sru")
LSTMConfig = config_class("lm", "lstm")
GRUConfig = config_class("lm", "gru")
TransformerConfig = config_class("lm", "transformer")
SRUppClassifierConfig = config_class("classify", "srupp")
SRUClassifierConfig = config_class("classify", "sru")
LSTMClassifierConfig = config_class("classify", "lstm")
GRUClassifierConfig = config_class("classify", "gru")
TransformerClassifierConfig = config_class("classify", "transformer")
SRUppSeq2SeqConfig = config_class("translate", "srupp")
SRUSeq2SeqConfig = config_class("translate", "sru")
LSTMSeq2SeqConfig = config_class("translate", "lstm")
GRUSeq2SeqConfig = config_class("translate", "gru")
TransformerSeq2SeqConfig = config_class("translate", "transformer")
