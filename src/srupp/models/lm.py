"""The SRU++ language model: embedding → dropout → causal SRU++ stack → dropout → output.

With ``adaptive_cutoffs`` the embedding is an adaptive input and the output a
projected adaptive softmax (:mod:`srupp.nn.adaptive`), as in the paper's
WikiText-103 and Billion Word models; otherwise a plain embedding and linear output.

Read it top to bottom: the config, the model, then generation and saving.
Shapes: B batch, L time, d model width, V vocabulary.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError
from ..nn import SRUpp, SRUppState
from ..nn.adaptive import AdaptiveInput, ProjectedAdaptiveLogSoftmax, check_cutoffs

MODEL_TYPES = ("srupp", "sru", "lstm", "gru", "transformer")


@dataclass
class LMConfig:
    """Shape of the language model. Defaults give a small byte-level model."""

    vocab_size: int = 256                 # V; 256 for byte-level text
    d_model: int = 256                    # d: embedding, hidden and output width
    proj_size: int = 64                   # d′: attention width; the paper uses d/4
    num_layers: int = 4                   # the paper uses 10
    num_heads: int = 1                    # the paper uses single-head attention
    dropout: float = 0.1                  # inside SRU++ layers and on the highway
    emb_dropout: Optional[float] = None   # after the embedding and before the output; None = dropout
    attn_dropout: float = 0.0             # on attention weights
    highway_bias: float = -2.0            # initial b_r: start close to the skip path
    attention_every_n_layers: int = 1     # attention in layers i with (i+1) % n == 0
    attention_last_n_layers: int = -1     # or only in the last n layers (-1: off)
    mem_len: Optional[int] = None         # past tokens each layer attends to; None: unbounded
    tie_embeddings: bool = False          # share input and output embeddings (enwik8: untied)
    layer_norm: bool = False              # layer-wise LayerNorm (the paper: only inside attention)
    normalize_after: bool = False         # post-norm when layer_norm
    adaptive_cutoffs: Optional[List[int]] = None  # adaptive input/softmax clusters; None: plain
    div_val: int = 4                      # adaptive cluster i is emb_dim // div_val**i wide
    emb_dim: Optional[int] = None         # n_e, adaptive cluster 0's width; None: d_model
    tie_projections: bool = True          # with tie_embeddings, share the cluster projections too
    type: str = "srupp"                   # srupp, or a baseline: sru, lstm, gru, transformer
    projection_size: int = 0              # sru: factorise each layer's W through this width (0: off)
    positions: Optional[str] = None       # transformer: learned|sinusoidal; None: sinusoidal if memory
    max_positions: int = 2048             # transformer, learned positions: longest context
    ffn_mult: int = 4                     # transformer: MLP width is ffn_mult·d_model

    def __post_init__(self):
        if self.type not in MODEL_TYPES:
            raise UserError(f"model.type must be one of {', '.join(MODEL_TYPES)}; "
                            f"got {self.type!r}")
        for name in ("vocab_size", "d_model", "proj_size", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise UserError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.type == "srupp" and self.proj_size % self.num_heads:
            raise UserError(f"model.num_heads ({self.num_heads}) must divide "
                            f"model.proj_size ({self.proj_size})")
        for name in ("dropout", "attn_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.emb_dropout is not None and not 0 <= self.emb_dropout < 1:
            raise UserError(f"model.emb_dropout must be in [0, 1), got {self.emb_dropout}")
        if self.mem_len is not None and self.mem_len < 0:
            raise UserError(f"model.mem_len must be >= 0, got {self.mem_len}")
        self._check_baseline()
        if self.adaptive_cutoffs is None:
            if self.emb_dim is not None or self.div_val != 4:
                raise UserError("model.emb_dim and model.div_val only apply to adaptive "
                                "embeddings: set model.adaptive_cutoffs too, or unset them")
        else:
            self.adaptive_cutoffs = check_cutoffs(self.adaptive_cutoffs, self.vocab_size,
                                                  where="model.adaptive_cutoffs")
            if self.div_val < 1:
                raise UserError(f"model.div_val must be >= 1, got {self.div_val}")
            if self.emb_dim is not None and self.emb_dim < 1:
                raise UserError(f"model.emb_dim must be >= 1, got {self.emb_dim}")
            n_e, last = self.emb_dim or self.d_model, len(self.adaptive_cutoffs)
            if n_e // self.div_val ** last < 1:
                raise UserError(f"model.emb_dim ({n_e}) // model.div_val**{last} is 0: the "
                                f"last cluster would have no width; raise model.emb_dim or "
                                f"lower model.div_val")

    def _check_baseline(self):
        """The fields only baselines read."""
        if self.projection_size < 0:
            raise UserError(f"model.projection_size must be >= 0, got {self.projection_size}")
        if self.type != "transformer":
            return
        if self.d_model % self.num_heads:
            raise UserError(f"model.num_heads ({self.num_heads}) must divide "
                            f"model.d_model ({self.d_model}) for a transformer")
        for name in ("max_positions", "ffn_mult"):
            if getattr(self, name) < 1:
                raise UserError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.positions not in (None, "learned", "sinusoidal"):
            raise UserError(f"model.positions must be learned or sinusoidal, "
                            f"got {self.positions!r}")
        if self.positions == "learned" and self.mem_len != 0:
            raise UserError("model.positions=learned needs model.mem_len=0: with memory, positions "
                            "continue across segments past any table; use sinusoidal")

    @property
    def transformer_positions(self) -> str:
        """The transformer's position encoding, with the default resolved."""
        if self.positions is not None:
            return self.positions
        return "learned" if self.mem_len == 0 else "sinusoidal"

    @classmethod
    def from_dict(cls, d: dict) -> "LMConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"unknown model config keys {unknown}; known: {sorted(known)}")
        return cls(**d)


@dataclass
class LMOutput:
    """logits (B, L, V); loss: mean nats per target token (None without targets); state.

    With an adaptive softmax (``adaptive_cutoffs``), ``logits`` are normalised
    log-probabilities, and they are None when targets are given (the loss
    then computes only the clusters the targets need). Softmax, argmax,
    temperature and top-k/top-p treat log-probabilities exactly as logits.
    """

    logits: Optional[Tensor]
    loss: Optional[Tensor]
    state: Any  # SRUppState, or TensorState for the baselines


class CausalLM(nn.Module):
    """What every language model here shares: embedding, output head, generation, saving.

    embedding → dropout → body → dropout → output. A subclass builds its body
    in :meth:`build_body`, initialises it in :meth:`reset_body`, runs it in
    :meth:`body` and makes its empty state in :meth:`initial_state`.
    Build one with :func:`srupp.models.build_model`, which reads ``config.type``.
    """

    def __init__(self, config: LMConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        c = config
        factory = {"device": device, "dtype": dtype}
        self.adaptive = c.adaptive_cutoffs is not None
        if self.adaptive:
            shape = dict(cutoffs=c.adaptive_cutoffs, div_val=c.div_val,
                         emb_dim=c.emb_dim or c.d_model)
            self.embedding = AdaptiveInput(c.vocab_size, c.d_model, **shape, **factory)
        else:
            self.embedding = nn.Embedding(c.vocab_size, c.d_model, **factory)
        p_emb = c.dropout if c.emb_dropout is None else c.emb_dropout
        self.emb_dropout = nn.Dropout(p_emb)
        self.build_body(factory)
        self.out_dropout = nn.Dropout(p_emb)
        if self.adaptive:
            tied = self.embedding if c.tie_embeddings else None
            self.output = ProjectedAdaptiveLogSoftmax(
                c.vocab_size, c.d_model, **shape, tie_embeddings=tied,
                tie_projections=c.tie_projections and c.tie_embeddings, **factory)
        else:
            self.output = nn.Linear(c.d_model, c.vocab_size, **factory)
            if c.tie_embeddings:
                self.output.weight = self.embedding.weight
        self.reset_parameters()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def reset_parameters(self):
        """The reference's enwik8 init: U(±√(3/d)) for the embedding and output, zero output bias.

        Adaptive embeddings and softmax use their own init, which gives the
        same input scale (variance 1/d per element): see :mod:`srupp.nn.adaptive`.
        """
        if self.adaptive:
            self.embedding.reset_parameters()
            self.output.reset_parameters()
            self.reset_body()
            return
        bound = math.sqrt(3.0 / self.config.d_model)
        nn.init.uniform_(self.embedding.weight, -bound, bound)
        if not self.config.tie_embeddings:
            nn.init.uniform_(self.output.weight, -bound, bound)
        nn.init.zeros_(self.output.bias)
        self.reset_body()

    # ------------------------------------------------- what subclasses supply
    def build_body(self, factory: dict) -> None:
        raise NotImplementedError

    def reset_body(self) -> None:
        raise NotImplementedError

    def body(self, x: Tensor, state, mask_pad: Optional[Tensor]) -> Tuple[Tensor, Any]:
        """x (B, L, d) embedded tokens -> (h (B, L, d), new state)."""
        raise NotImplementedError

    def body_modules(self) -> List[nn.Module]:
        """The modules between embedding and output, for parameter counts."""
        raise NotImplementedError

    def initial_state(self, batch_size: int, *, mem_len: Optional[int] = None):
        raise NotImplementedError

    def generation_state(self, batch_size: int, mem_len: Optional[int] = None):
        """The state :meth:`generate` starts from (a transformer's KV cache grows unbounded)."""
        return self.initial_state(batch_size, mem_len=mem_len)

    def num_parameters(self) -> int:
        """Every parameter, embeddings and output included (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: Tensor, state: Optional[SRUppState] = None, *,
                targets: Optional[Tensor] = None, mask_pad: Optional[Tensor] = None) -> LMOutput:
        """Score a segment.

        Args:
            tokens: (B, L) token ids.
            state: the state returned for the previous segment, or None.
            targets: (B, L) next-token ids; -100 marks positions to ignore.
            mask_pad: (B, L) bool, True at padding.
        Returns:
            :class:`LMOutput`. With an adaptive softmax, ``logits`` are
            log-probabilities, and None when ``targets`` are given.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (B, L), got shape {tuple(tokens.shape)}")
        x = self.emb_dropout(self.embedding(tokens))              # (B, L, d)
        h, state = self.body(x, state, mask_pad)                  # (B, L, d)
        if self.adaptive:
            h = self.out_dropout(h)
            if targets is None:
                return LMOutput(logits=self.output.log_prob(h), loss=None, state=state)
            nll = self.output.loss(h, targets)                    # (B, L), 0 where ignored
            loss = nll.sum() / (targets != -100).sum()            # NaN when all are ignored,
            return LMOutput(logits=None, loss=loss, state=state)  # as F.cross_entropy
        logits = self.output(self.out_dropout(h))                 # (B, L, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                   ignore_index=-100)
        return LMOutput(logits=logits, loss=loss, state=state)

    # ------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float = 1.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, eos_id: Optional[int] = None,
                 stop_strings: Sequence[str] = (), decode: Optional[Callable] = None,
                 mem_len: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 on_tokens: Optional[Callable[[Tensor], None]] = None) -> List[List[int]]:
        """Sample continuations of a batch of prompts.

        The prompts are left-padded and prefilled in one pass; then one token
        per step is decoded through the :class:`SRUppState`, never recomputing
        the prefix.

        Args:
            prompts: B non-empty sequences of token ids, of any lengths.
            max_new_tokens: tokens to generate per prompt at most.
            temperature: 0 picks the most likely token (greedy).
            top_k, top_p: keep only the k most likely tokens / the smallest set
                with probability mass ≥ p.
            eos_id: a sequence ends after this token (it is kept in the output).
            stop_strings: a sequence ends once its decoded text contains one of
                these (the text is cut before it); needs ``decode``.
            decode: ids -> str, for stop strings.
            mem_len: attention window while decoding; defaults to the model's.
            generator: a seeded torch.Generator makes sampling repeatable.
            on_tokens: called with the (B,) tokens of each step, for streaming.
        Returns:
            B lists of new token ids (prompt excluded).
        """
        if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
            raise UserError("generate needs at least one prompt, and every prompt needs a token")
        if stop_strings and decode is None:
            raise ValueError("stop_strings need decode= to turn ids into text")
        device = self.device
        B, Lp = len(prompts), max(len(p) for p in prompts)
        tokens = torch.zeros(B, Lp, dtype=torch.long, device=device)
        pad = torch.ones(B, Lp, dtype=torch.bool, device=device)
        for b, p in enumerate(prompts):
            tokens[b, Lp - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            pad[b, Lp - len(p):] = False
        state = self.generation_state(B, mem_len)
        out = self(tokens, state, mask_pad=pad if bool(pad.any()) else None)
        logits, state = out.logits[:, -1], out.state              # (B, V)
        new: List[List[int]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            nxt = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                         generator=generator)                     # (B,)
            if on_tokens is not None:
                on_tokens(torch.where(done, torch.full_like(nxt, -1), nxt))
            for b in range(B):
                if not done[b]:
                    new[b].append(int(nxt[b]))
            if eos_id is not None:
                done |= nxt == eos_id
            if stop_strings:
                for b in range(B):
                    if not done[b]:
                        text = decode(new[b])
                        if any(s in text for s in stop_strings):
                            done[b] = True
            if bool(done.all()):
                break
            logits, state = self.step(nxt, state)
        if stop_strings:
            new = [_cut_at_stop(ids, decode, stop_strings) for ids in new]
        return new

    def step(self, tokens: Tensor, state) -> Tuple[Tensor, Any]:
        """One token per sequence, for decoding: tokens (B,) -> (logits (B, V), new state).

        The same as ``forward`` on (B, 1) tokens; models with a leaner
        single-token path override it.
        """
        out = self(tokens.unsqueeze(1), state)
        return out.logits[:, -1], out.state

    # ---------------------------------------------------------------- saving
    def save_pretrained(self, directory: Union[str, os.PathLike]) -> None:
        """Write ``config.json`` and ``model.safetensors`` into ``directory``."""
        from safetensors.torch import save_model

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        _atomic_write_text(d / "config.json", json.dumps(asdict(self.config), indent=2))
        tmp = d / "model.safetensors.tmp"
        save_model(self, str(tmp))
        os.replace(tmp, d / "model.safetensors")

    @classmethod
    def from_pretrained(cls, directory: Union[str, os.PathLike], *,
                        device=None) -> "CausalLM":
        """Load a model saved by :meth:`save_pretrained`, in eval mode.

        The class follows the saved ``type`` (a LanguageModel for srupp, or a
        baseline), whichever class this is called on.

        Reads only JSON and safetensors: loading never executes code from the files.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_model

        d = Path(directory)
        try:
            config = LMConfig.from_dict(json.loads((d / "config.json").read_text()))
        except FileNotFoundError:
            raise UserError(f"{d} has no config.json: not a saved srupp model") from None
        except (json.JSONDecodeError, TypeError) as e:
            raise UserError(f"{d / 'config.json'} is corrupt ({e})") from None
        from .build import build_model

        model = build_model(config, device=device)
        try:
            load_model(model, str(d / "model.safetensors"), device=str(device or "cpu"))
        except FileNotFoundError:
            raise UserError(f"{d} has no model.safetensors") from None
        except (SafetensorError, RuntimeError, OSError) as e:
            raise UserError(f"{d / 'model.safetensors'} is truncated or corrupt "
                            f"({str(e).splitlines()[0]})") from None
        return model.eval()  # like a freshly loaded model elsewhere: ready for inference


class LanguageModel(CausalLM):
    """A causal SRU++ language model that carries its state across segments."""

    def build_body(self, factory: dict) -> None:
        c = self.config
        if c.type != "srupp":
            raise UserError(f"LanguageModel is the srupp model; build a {c.type!r} model with "
                            f"srupp.models.build_model")
        self.rnn = SRUpp(
            c.d_model, c.d_model, c.proj_size, c.num_layers, dropout=c.dropout,
            attn_dropout=c.attn_dropout, num_heads=c.num_heads, highway_bias=c.highway_bias,
            attention_every_n_layers=c.attention_every_n_layers,
            attention_last_n_layers=c.attention_last_n_layers, layer_norm=c.layer_norm,
            normalize_after=c.normalize_after, causal=True, mem_len=c.mem_len,
            batch_first=True, **factory)

    def reset_body(self) -> None:
        self.rnn.reset_parameters()

    def body(self, x: Tensor, state: Optional[SRUppState], mask_pad: Optional[Tensor]):
        return self.rnn(x, state, mask_pad=mask_pad)

    def body_modules(self) -> List[nn.Module]:
        return [self.rnn]

    def initial_state(self, batch_size: int, *, mem_len: Optional[int] = None) -> SRUppState:
        return self.rnn.initial_state(batch_size, device=self.device, mem_len=mem_len)

    def step(self, tokens: Tensor, state: Optional[SRUppState]) -> Tuple[Tensor, SRUppState]:
        """One token per sequence through :meth:`SRUpp.step` (decoding in eval mode).

        tokens (B,) -> (logits (B, V) (log-probabilities with an adaptive
        softmax), new state). In training mode it is ``forward`` on (B, 1).
        """
        if self.training:
            return super().step(tokens, state)
        x = self.embedding(tokens.unsqueeze(1)).squeeze(1)        # (B, d)
        h, state = self.rnn.step(x, state)                        # (B, d)
        if self.adaptive:
            return self.output.log_prob(h.unsqueeze(1)).squeeze(1), state
        return self.output(h), state


def sample(logits: Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """Draw one token per row. logits (B, V) -> (B,) long."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _cut_at_stop(ids: List[int], decode: Callable, stops: Sequence[str]) -> List[int]:
    """The longest prefix of ids whose text ends before the first stop string begins."""
    text = decode(ids)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return ids
    start = min(hits)
    n = 0
    while n < len(ids) and len(decode(ids[:n + 1])) <= start:
        n += 1
    return ids[:n]


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
