"""Language modelling: a token stream, the state carried, bits per character or perplexity.

:class:`LMTask` is the ``lm`` task (:mod:`srupp.train.tasks` has the interface);
:func:`evaluate` scores a language model on a token stream, for validation,
``srupp eval`` and ``srupp compare``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from ..data import StreamBatcher, build_tokenizer, load_corpus, tokenizer_from_dict
from ..errors import UserError, user_input
from ..inference import autocast_context, to_device
from ..runs import TOKENIZER
from .tasks import SPEED_REPEATS, Task, check_tokenizer_fits, loss_sum, median_rate, time_to_note

# tokenizers whose tokens are bytes or characters: their runs are measured in
# bits per character; word and subword runs in perplexity per token
CHARACTER_LEVEL = ("byte", "char")


def bits(loss: float) -> float:
    """A loss in nats per token as bits per token (per character at byte or char level)."""
    return loss / math.log(2)


def perplexity(loss: float) -> float:
    """A loss in nats per token as perplexity; capped where ``math.exp`` would overflow."""
    return math.exp(min(loss, 700.0))


# a language model's loss (nats per token) in its metric's unit, and that unit's name
LOSS_UNITS = {"bpc": (bits, "bits per character"), "ppl": (perplexity, "perplexity per token")}


def metric_for(tokenizer: Any) -> str:
    """The validation metric a run on ``tokenizer`` reports: ``"bpc"`` or ``"ppl"``.

    Bits per token are bits per character only when tokens are bytes or
    characters (``"byte"``, ``"char"``); word and subword models report
    perplexity. ``tokenizer`` is a tokenizer, its ``to_dict()`` or its type name.
    """
    if not isinstance(tokenizer, (str, dict)):
        tokenizer = tokenizer.to_dict()
    kind = tokenizer.get("type") if isinstance(tokenizer, dict) else tokenizer
    return "bpc" if kind in CHARACTER_LEVEL else "ppl"


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, *, batch_size: int, unroll: int,
             mem_len: Optional[int] = None, precision: str = "fp32",
             max_batches: Optional[int] = None, rank: int = 0,
             world_size: int = 1) -> Dict[str, float]:
    """Mean loss over ``ids``, read as ``batch_size`` streams in segments of ``unroll``.

    With ``world_size`` > 1, ``ids`` is cut into ``batch_size * world_size``
    streams and this call scores share ``rank`` of them (the caller sums the
    ranks' results).

    The state, memory included, is carried from segment to segment, with an
    attention window of ``mem_len`` (the model's when None).

    A model with an adaptive softmax (``model.adaptive``) is scored through
    its ``targets=`` loss, which skips the unneeded clusters, instead of
    materialising (B, L, V) log-probabilities.

    Returns:
        ``loss`` (nats per token), ``ppl`` (its exponential, the metric of
        word and subword models), ``bpc`` (bits per token: bits per
        character for byte- and character-level models), ``tokens`` scored
        and ``seconds`` taken.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    batcher = StreamBatcher(ids, batch_size, unroll, rank=rank, world_size=world_size)
    start = time.perf_counter()
    total, count, state = 0.0, 0, None
    adaptive = getattr(model, "adaptive", False)
    try:
        for i, (x, y) in enumerate(batcher):
            if max_batches is not None and i >= max_batches:
                break
            if state is None:
                state = model.initial_state(x.shape[0], mem_len=mem_len)
            x, y = to_device(x, device), to_device(y, device)
            with autocast_context(precision, device.type):
                out = model(x, state, targets=y) if adaptive else model(x, state)
            if adaptive:
                n = int((y != -100).sum())
                total += out.loss.item() * n if n else 0.0
            else:
                total += F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten(),
                                         reduction="sum").item()
                n = y.numel()
            state = out.state
            count += n
    finally:
        model.train(was_training)
    loss = total / max(count, 1)
    return {"loss": loss, "bpc": bits(loss), "ppl": perplexity(loss),
            "tokens": count, "seconds": time.perf_counter() - start}


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
        fields = super().model_fields(cfg, num_labels)
        if cfg.model.get("mem_len") is None:  # the attention window: one training segment
            fields["mem_len"] = cfg.train.unroll
        return fields

    def load(self, saved: Optional[Dict[str, Any]]) -> None:
        cfg = self.cfg
        with user_input():
            self.corpus = load_corpus(cfg.data.corpus)
        if saved is not None:
            with user_input():
                self.tokenizer = tokenizer_from_dict(saved[TOKENIZER])
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
        return {TOKENIZER: self.tokenizer.to_dict()}

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
            res.update(loss=loss, bpc=bits(loss), ppl=perplexity(loss), tokens=int(count))
        out = {"bpc": res["bpc"]} if self.metric == "bpc" else {}
        out.update(ppl=res["ppl"], loss=res["loss"], tokens=res["tokens"])
        return out

    def summary_keys(self):
        return ("loss", "ppl", "bpc") if self.metric == "bpc" else ("loss", "ppl")

    def bar_value(self, loss: float) -> Dict[str, str]:
        value = LOSS_UNITS[self.metric][0](loss)
        return {self.metric: f"{value:.3f}" if self.metric == "bpc" else f"{value:.1f}"}

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
