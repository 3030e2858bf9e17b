"""Evaluation of a language model on a token stream."""

from __future__ import annotations

import math
import time
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from ..data import StreamBatcher
from ..inference import autocast_context, to_device


# tokenizers whose tokens are bytes or characters: their runs are measured in
# bits per character; word and subword runs in perplexity per token
CHARACTER_LEVEL = ("byte", "char")


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
    materialising (B, L, V) log-probabilities; other models as before.

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
    return {"loss": loss, "bpc": loss / math.log(2), "ppl": math.exp(min(loss, 700.0)),
            "tokens": count, "seconds": time.perf_counter() - start}
