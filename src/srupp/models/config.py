"""The model configs: the fields every language model shares, then one dataclass per model type.

Each model class names its config class (:mod:`srupp.models.lm` keeps the
registry ``type -> (config class, model class)``); a config holds only the
fields its model reads. Defaults give a small byte-level model. Bad values
raise ValueError in the terms of these fields: each class's ``_ranges`` gives
its numbers' ranges, and every float must be finite (``highway_bias`` too),
checked by :func:`srupp._ranges.check_fields` before anything else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar, List, Optional

from .._ranges import check_fields
from ..nn.adaptive import check_cutoffs
from ..nn.srupp import check_attention_layout
from .base import REGISTRY

# Every field LMConfig had when it was one flat union of all model types. A
# config.json saved then holds all of them (see LMConfig.from_dict).
FLAT_FIELDS = frozenset(
    "vocab_size d_model proj_size num_layers num_heads dropout emb_dropout attn_dropout "
    "highway_bias attention_every_n_layers attention_last_n_layers mem_len tie_embeddings "
    "layer_norm normalize_after adaptive_cutoffs div_val emb_dim tie_projections type "
    "projection_size positions max_positions ffn_mult".split())


@dataclass
class LMConfig:
    """What every model shares: vocabulary, width, depth, dropout, memory and embeddings.

    Not built directly: use the config of a model type (SRUppConfig, ...).
    """

    task: ClassVar[str] = "lm"                    # what the model does (srupp.models.base.TASKS)
    type: ClassVar[str] = ""                      # the model type; set by each subclass

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

    # each number's range (srupp._ranges; a subclass's table adds to its bases')
    _ranges = {"vocab_size": ">= 1", "d_model": ">= 1", "num_layers": ">= 1",
               "dropout": "[0, 1)", "emb_dropout": "[0, 1)", "mem_len": ">= 0",
               "div_val": ">= 1", "emb_dim": ">= 1"}

    def __post_init__(self):
        if not self.type:
            raise TypeError("LMConfig holds the fields every model shares; build the config "
                            "of a model type (SRUppConfig, SRUConfig, LSTMConfig, GRUConfig, "
                            "TransformerConfig) or use config_from_dict({'type': ...})")
        check_fields(self)  # every number of this type's config, subclasses' included
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

    def to_dict(self) -> dict:
        """The fields, and ``type``: what config_from_dict reads back."""
        return {"type": self.type, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "LMConfig":
        """This config from its fields (``type`` and ``task`` already taken out).

        A key that belongs to another model type is an error, except in a config
        saved before the per-type configs (it holds every field of every type):
        there the model of its type never read the other types' fields, so they
        are dropped, whatever their values.
        """
        d = dict(d)
        own = {f.name for f in fields(cls)}
        flat = FLAT_FIELDS <= set(d) | {"type"}
        for key in sorted(set(d) - own):
            users = [t for t, (c, _) in REGISTRY["lm"].items()
                     if key in {f.name for f in fields(c)}]
            if not users:
                raise ValueError(f"unknown config key {key!r}; a {cls.type} config has "
                                 f"{', '.join(sorted(own))}")
            if not flat:
                raise ValueError(f"{key} applies to type={' or '.join(users)}, not {cls.type}")
            del d[key]
        return cls(**d)


@dataclass
class SRUppConfig(LMConfig):
    """The SRU++ model: SRU layers whose input projection attends to the past."""

    type: ClassVar[str] = "srupp"

    proj_size: int = 64                   # d′: attention width; the paper uses d/4
    num_heads: int = 1                    # the paper uses single-head attention
    attn_dropout: float = 0.0             # on attention weights
    highway_bias: float = -2.0            # initial b_r: start close to the skip path
    attention_every_n_layers: int = 1     # attention in layers i with (i+1) % n == 0
    attention_last_n_layers: int = -1     # or only in the last n layers (-1: off)
    layer_norm: bool = False              # layer-wise LayerNorm (the paper: only inside attention)
    normalize_after: bool = False         # post-norm when layer_norm

    _ranges = {"proj_size": ">= 1", "num_heads": ">= 1", "attn_dropout": "[0, 1)"}

    def __post_init__(self):
        super().__post_init__()
        if self.proj_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide "
                             f"proj_size ({self.proj_size})")
        check_attention_layout(self.num_layers, self.attention_every_n_layers,
                               self.attention_last_n_layers)


@dataclass
class SRUConfig(LMConfig):
    """A stack of plain SRU layers, without attention."""

    type: ClassVar[str] = "sru"

    projection_size: int = 0              # factorise each layer's W through this width (0: off)
    highway_bias: float = -2.0            # initial b_r: start close to the skip path
    layer_norm: bool = False              # layer-wise LayerNorm
    normalize_after: bool = False         # post-norm when layer_norm

    _ranges = {"projection_size": ">= 0"}


@dataclass
class LSTMConfig(LMConfig):
    """torch.nn.LSTM: the shared fields say everything."""

    type: ClassVar[str] = "lstm"


@dataclass
class GRUConfig(LMConfig):
    """torch.nn.GRU: the shared fields say everything."""

    type: ClassVar[str] = "gru"


@dataclass
class TransformerConfig(LMConfig):
    """A decoder-only pre-LN transformer, with optional segment memory (mem_len)."""

    type: ClassVar[str] = "transformer"

    num_heads: int = 1                    # must divide d_model
    attn_dropout: float = 0.0             # on attention weights
    positions: Optional[str] = None       # learned|sinusoidal; None: learned without memory
    max_positions: int = 2048             # the learned table's length: the longest context
    ffn_mult: int = 4                     # the MLP is ffn_mult·d_model wide

    _ranges = {"num_heads": ">= 1", "attn_dropout": "[0, 1)", "max_positions": ">= 1",
               "ffn_mult": ">= 1"}

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide "
                             f"d_model ({self.d_model})")
        if self.positions not in (None, "learned", "sinusoidal"):
            raise ValueError(f"positions must be 'learned', 'sinusoidal' or None, "
                             f"got {self.positions!r}")
        if self.positions == "learned" and self.mem_len != 0:
            raise ValueError("positions='learned' needs mem_len=0: with memory, the position "
                             "count runs on across segments past any table; use sinusoidal")

    @property
    def resolved_positions(self) -> str:
        """positions, with None resolved: learned without memory, else sinusoidal."""
        return self.positions or ("learned" if self.mem_len == 0 else "sinusoidal")
