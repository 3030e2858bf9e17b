"""The causal language model: embedding → dropout → causal backbone → dropout → output.

With ``adaptive_cutoffs`` the embedding is an adaptive input and the output a
projected adaptive softmax (:mod:`srupp.nn.adaptive`), as in the paper's
WikiText-103 and Billion Word models; otherwise a plain embedding and linear
output. The backbone (:mod:`srupp.models.backbones`) is the config's ``type``.
Shapes: B batch, L time, d model width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._ranges import check
from ..nn.adaptive import AdaptiveInput, ProjectedAdaptiveLogSoftmax
from ..nn.linear import Linear
from ..nn.stack_step import output_args
from ..ops.settings import tuning
from .base import SavedModel, init_embedding
from .config import LMConfig


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
    state: Any  # SRUppState, or TensorState for the other backbones


class CausalLM(SavedModel):
    """A language model over any backbone, carrying its state across segments.

    Build one with :func:`srupp.models.build_model`, which reads ``config.type``.
    """

    task = "lm"

    def __init__(self, config: LMConfig, *, device=None, dtype=None):
        super().__init__(config, device=device, dtype=dtype)
        c, factory = config, self.factory
        self.adaptive = c.adaptive_cutoffs is not None
        if self.adaptive:
            shape = dict(cutoffs=c.adaptive_cutoffs, div_val=c.div_val,
                         emb_dim=c.emb_dim or c.d_model)
            self.embedding = AdaptiveInput(c.vocab_size, c.d_model, **shape, **factory)
        else:
            self.embedding = nn.Embedding(c.vocab_size, c.d_model, **factory)
        p_emb = c.dropout if c.emb_dropout is None else c.emb_dropout
        self.emb_dropout = nn.Dropout(p_emb)
        self.backbone = self.make_backbone("causal")
        self.out_dropout = nn.Dropout(p_emb)
        if self.adaptive:
            tied = self.embedding if c.tie_embeddings else None
            self.output = ProjectedAdaptiveLogSoftmax(
                c.vocab_size, c.d_model, **shape, tie_embeddings=tied,
                tie_projections=c.tie_projections and c.tie_embeddings, **factory)
        else:
            self.output = Linear(c.d_model, c.vocab_size, **factory)  # nn.Linear, fast decoding
            if c.tie_embeddings:
                self.output.weight = self.embedding.weight
        self.reset_parameters()

    def reset_parameters(self):
        """U(±√(3/d)) embedding and output, zero output bias; then the backbone.

        Adaptive embeddings and softmax use their own init, which gives the
        same input scale (variance 1/d per element): see :mod:`srupp.nn.adaptive`.
        """
        if self.adaptive:
            self.embedding.reset_parameters()
            self.output.reset_parameters()
        else:
            init_embedding(self.embedding, self.output)
        self.backbone.reset_parameters()

    def initial_state(self, batch_size: int, *, mem_len: Optional[int] = None):
        """The state before the first segment (memory of ``mem_len``; None: the config's)."""
        return self.backbone.initial_state(batch_size, mem_len)

    def generation_state(self, batch_size: int, mem_len: Optional[int] = None):
        """The state :meth:`generate` starts from (a transformer's KV cache keeps every position
        unless given ``mem_len``)."""
        return self.backbone.generation_state(batch_size, mem_len)

    def forward(self, tokens: Tensor, state=None, *, targets: Optional[Tensor] = None,
                mask_pad: Optional[Tensor] = None) -> LMOutput:
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
        h, state = self.backbone(x, state, mask_pad)              # (B, L, d)
        h = self.out_dropout(h)
        if self.adaptive and targets is not None:
            nll = self.output.loss(h, targets)                    # (B, L), 0 where ignored
            loss = nll.sum() / (targets != -100).sum()            # NaN when all are ignored,
            return LMOutput(logits=None, loss=loss, state=state)  # as F.cross_entropy
        logits = self.output.log_prob(h) if self.adaptive else self.output(h)  # (B, L, V)
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
        per step is decoded through the backbone's state, never recomputing
        the prefix.

        Args:
            prompts: B non-empty sequences of token ids, of any lengths.
            max_new_tokens: tokens to generate per prompt at most (>= 0).
            temperature: divides the logits before sampling; a finite number
                >= 0, and 0 picks the most likely token (greedy: no sampling,
                top_k and top_p change nothing).
            top_k, top_p: keep only the k most likely tokens (k >= 1) / the
                smallest set with probability mass ≥ p (p in (0, 1]).
            eos_id: a sequence ends after this token (it is kept in the output).
            stop_strings: a sequence ends once its decoded text contains one of
                these (the text is cut before it); needs ``decode``.
            decode: ids -> str, for stop strings.
            mem_len: attention window while decoding (>= 0); defaults to the model's.
            generator: a seeded torch.Generator makes sampling repeatable (on the
                model's device, or on the CPU, which then draws the tokens).
            on_tokens: called with the (B,) tokens of each step, for streaming.
        Returns:
            B lists of new token ids (prompt excluded).

        A number out of its range (or nan, inf) is a ValueError naming it.
        """
        check("max_new_tokens", max_new_tokens, ">= 0", integer=True)
        check("mem_len", mem_len, ">= 0", integer=True)
        check_sampling(temperature, top_k, top_p)
        if len(prompts) == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, and every prompt needs a token")
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
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        chunks = None if stop_strings else self._fused_chunks(logits, state, max_new_tokens,
                                                              eos_id, sampling, on_tokens)
        if chunks is None:
            chunks = self._step_chunks(logits, state, max_new_tokens, sampling)
        new: List[List[int]] = [[] for _ in range(B)]
        done = [False] * B
        # chunks (B, t) of t steps' tokens; each step's B tokens in turn
        for ids in (ids for chunk in chunks for ids in chunk.t().tolist()):
            if on_tokens is not None:
                on_tokens(torch.tensor([-1 if d else i for d, i in zip(done, ids)],
                                       device=device))
            for b in range(B):
                if not done[b]:
                    new[b].append(ids[b])
                    if stop_strings and any(s in decode(new[b]) for s in stop_strings):
                        done[b] = True
                if ids[b] == eos_id:
                    done[b] = True
            if all(done):
                break
        if stop_strings:
            new = [_cut_at_stop(ids, decode, stop_strings) for ids in new]
        return new

    def _step_chunks(self, logits: Tensor, state, n: int, sampling: dict) -> Iterator[Tensor]:
        """The tokens of n steps, one (B, 1) chunk at a time, through :meth:`step`."""
        for i in range(n):
            nxt = sample(logits, **sampling)                      # (B,)
            yield nxt.unsqueeze(1)
            if i + 1 < n:  # (not reached once the caller stops)
                logits, state = self.step(nxt, state)

    def fused_decoder(self, state, n: int, like: Tensor) -> Optional[tuple]:
        """(plan, output) for :meth:`StepPlan.decode <srupp.nn.stack_step.StepPlan.decode>`:
        n tokens from ``state`` in one C++ call, rows like ``like`` (B, d); None where that call
        can't run this model (training, an adaptive or a non-plain embedding, an output layer
        it doesn't compute as the module does, a backbone other than an eval-mode causal
        SRU++ stack, not the CPU)."""
        emb = self.embedding
        if n == 0 or self.training or self.adaptive or type(emb) is not nn.Embedding \
                or emb.max_norm is not None or like.device.type != "cpu":
            return None
        output = output_args(self.output, like)
        if output is None:
            return None
        plan = self.backbone.decode_plan(state, n, like)
        return None if plan is None else (plan, output)

    def _fused_chunks(self, logits: Tensor, state, n: int, eos_id: Optional[int],
                      sampling: dict, on_tokens: Optional[Callable]
                      ) -> Optional[Iterator[Tensor]]:
        """The tokens of n steps in (B, ≤ chunk) chunks from the C++ ``decode_loop``
        (sampling, embedding, the SRU++ stack and the output layer in one call), the very
        tokens :meth:`_step_chunks` gives; None where :meth:`fused_decoder` says it can't
        run this model, the generator is not a CPU one, or the chunk,
        ``srupp.ops.settings.tuning().decode_chunk``, is 0. When streaming (``on_tokens``),
        chunks start at one token and double up to it."""
        generator = sampling["generator"]
        most = tuning().decode_chunk
        if most < 1 or (generator is not None and generator.device.type != "cpu") \
                or type(self.embedding) is not nn.Embedding:  # the loop embeds by lookup
            return None
        like = self.embedding.weight.new_empty(logits.shape[0], self.embedding.embedding_dim)
        chunk = most if on_tokens is None else 1
        decoder = self.fused_decoder(state, min(n, chunk), like)
        if decoder is None:
            return None
        return self._run_fused(decoder, like, logits, n, eos_id, sampling, chunk, most)

    def _run_fused(self, decoder: tuple, like: Tensor, logits: Tensor, n: int,
                   eos_id: Optional[int], sampling: dict, chunk: int,
                   most: int) -> Iterator[Tensor]:
        done = torch.zeros(like.shape[0], dtype=torch.bool)       # rows that sampled eos_id
        plan, output = decoder
        while True:
            t = plan.L
            tokens, logits, state = plan.decode(
                logits, done, self.embedding.weight, output, final=t == n, eos_id=eos_id,
                **sampling)                                       # tokens (B, ≤ t)
            yield tokens
            if tokens.shape[1] < t or t == n or bool(done.all()):  # all rows ended, or n ran
                return
            n -= t
            chunk = min(2 * chunk, most)  # streaming: the first tokens come soon
            decoder = self.fused_decoder(state, min(n, chunk), like)
            if decoder is None:  # the model changed under us (in on_tokens, say): step on
                yield from self._step_chunks(logits, state, n, sampling)
                return
            plan, output = decoder

    @torch.no_grad()
    def prefill(self, tokens: Tensor, state) -> Tuple[Tensor, Any]:
        """Read a chunk of tokens (B, L) into ``state``: (the last position's logits (B, V),
        the new state). ``forward`` without the logits of the other positions."""
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"prefill takes tokens (B, L >= 1), got {tuple(tokens.shape)}")
        h, state = self.backbone(self.embedding(tokens), state, None)    # (B, L, d)
        last = h[:, -1:]                                                  # (B, 1, d)
        logits = self.output.log_prob(last) if self.adaptive else self.output(last)
        return logits[:, 0], state

    def step(self, tokens: Tensor, state) -> Tuple[Tensor, Any]:
        """One token per sequence, for decoding: tokens (B,) -> (logits (B, V), new state).

        The same as ``forward`` on (B, 1) tokens; in eval mode through the
        backbone's ``step`` (SRU++: its one-token path).
        """
        if self.training:
            out = self(tokens.unsqueeze(1), state)
            return out.logits[:, -1], out.state
        x = self.embedding(tokens.unsqueeze(1)).squeeze(1)        # (B, d)
        h, state = self.backbone.step(x, state)                   # (B, d)
        if self.adaptive:
            return self.output.log_prob(h.unsqueeze(1)).squeeze(1), state
        return self.output(h), state


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """ValueError (TypeError for a non-number) unless temperature is a finite number >= 0
    (0: greedy), top_k None or an integer >= 1, and top_p None or in (0, 1]."""
    check("temperature", temperature, ">= 0")
    check("top_k", top_k, ">= 1", integer=True)
    check("top_p", top_p, "(0, 1]")


def sample(logits: Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
           top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """Draw one token per row. logits (B, V) -> (B,) long.

    temperature 0 is greedy: the most likely token (the argmax, whatever top_k
    and top_p); the arguments are checked as :func:`check_sampling` says.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
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
    if generator is not None and generator.device != probs.device:
        # a generator draws on its own device: a CPU one (torch.Generator()'s default)
        # samples a model's GPU logits on the CPU, as repeatable as on the CPU
        draw = torch.multinomial(probs.to(generator.device), 1, generator=generator)
        return draw.squeeze(-1).to(probs.device)
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
