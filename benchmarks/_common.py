"""Helpers shared by the benchmark scripts (each script puts this folder on sys.path
by being run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional


def seconds_per_call(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Mean wall seconds of ``fn()`` over ``reps`` calls, after ``warmup`` untimed calls
    (first-use compilation, allocator)."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of one ``fn()`` call over ``repeats`` timed calls, after
    ``warmup`` untimed ones: for short calls whose outliers (a page fault, another
    process) a mean would absorb."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bare_training_step(trainer, grad_clip: Optional[float] = None) -> Callable[[], None]:
    """One training step of ``trainer``'s model and data without the trainer around it.

    Forward under the run's precision, backward, optional gradient clipping,
    optimiser step; the recurrent state is carried (detached) from step to step.
    """
    import torch

    from srupp.inference import autocast_context

    model, opt = trainer.model, trainer.optimizer
    batches = trainer.batcher.iter_from(0)
    state = None

    def step():
        nonlocal state
        b = next(batches)
        with autocast_context(trainer.precision, "cpu"):
            out = model(b.inputs, state, targets=b.targets)
        out.loss.backward()
        state = out.state.detach()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def add_layer_shape_args(ap) -> None:
    """The layer benchmark's shape (the issue's: a 2-layer SRU++, L=256, B=16,
    input and hidden 512, proj_size 128) as --L --B --d --proj arguments."""
    ap.add_argument("--L", type=int, default=256, help="sequence length")
    ap.add_argument("--B", type=int, default=16, help="batch size")
    ap.add_argument("--d", type=int, default=512, help="input and hidden size")
    ap.add_argument("--proj", type=int, default=128, help="proj_size d′")


def layer_model_and_input(args):
    """The layer benchmark's model and input, from ``add_layer_shape_args``'s arguments:
    a seeded 2-layer causal SRU++ and a time-major input x (L, B, d)."""
    import torch

    from srupp.nn import SRUpp

    torch.manual_seed(0)
    model = SRUpp(args.d, args.d, args.proj, num_layers=2, causal=True)
    return model, torch.randn(args.L, args.B, args.d)


def layer_training_step(model, x, bf16: bool) -> Callable[[], None]:
    """One forward and backward of ``model`` on ``x`` (fp32, or under bf16 autocast);
    the loss is the output's sum."""
    import torch

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out, _ = model(x)
        out.float().sum().backward()
    return run


def causal_mask(L: int):
    """The additive causal mask (L, L) that the reference and ``nn.TransformerEncoder``
    are called with (srupp builds its own from ``causal=True``: same computation)."""
    import torch

    return torch.triu(torch.full((L, L), float("-inf")), diagonal=1)


def reference_layer(args):
    """``sru==3.0.0.dev6``'s SRUpp at the layer benchmark's shape; raises ImportError
    when it is not installed."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sru
    return sru.SRUpp(args.d, args.d, args.proj, num_layers=2)


def reference_call(ref, x, causal, train: bool) -> Callable[[], None]:
    """The reference's training step (forward and backward of the output's sum) or,
    with ``train=False``, its inference under ``no_grad``; its warnings silenced."""
    import warnings

    import torch

    def run():
        with warnings.catch_warnings(), torch.set_grad_enabled(train):
            warnings.simplefilter("ignore")
            h, _, _ = ref(x, attn_mask=causal)
        if train:
            h.sum().backward()
    return run


def lm_training_step(cfg, vocab: int, bf16: bool, *, compiled: bool = False,
                     optimizer_range: Optional[str] = None):
    """(step, model): ``cfg``'s language model on random tokens: forward under the
    precision, backward, clip, RAdam step, state carried from step to step.

    ``compiled`` runs the forward through ``torch.compile``; ``optimizer_range``
    names a profiler range around the clip and the optimizer step.
    """
    import contextlib

    import torch
    from torch.profiler import record_function

    from srupp.models import build_model

    torch.manual_seed(0)
    model = build_model(cfg.model_config(vocab))
    model.train()
    t = cfg.train
    opt = torch.optim.RAdam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                            decoupled_weight_decay=True)
    forward = torch.compile(model) if compiled else model
    B, L = t.batch_size, t.unroll
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (B, L + 1), generator=g) for _ in range(4)]
    state, i = None, 0

    def step():
        nonlocal state, i
        b = batches[i % len(batches)]
        i += 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = forward(b[:, :-1], state, targets=b[:, 1:])
        out.loss.backward()
        state = out.state.detach()
        with (record_function(optimizer_range) if optimizer_range
              else contextlib.nullcontext()):
            if t.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step, model


def model_flops_per_token(model, mem_len: int, unroll: int) -> int:
    """Training FLOPs a token costs, as MFU counts them (no recomputation, no
    element-wise work): 6 per weight of every matrix product (forward 2, backward 4;
    embedding lookups are not products), plus, in each attention layer, scores and
    values (2 products of the attention width per key, forward and backward:
    3 x 2 x 2) over the keys a query sees on average (the memory and half the segment).

    The attention width is d' for an SRU++ layer and d_model for a transformer block.
    """
    import torch

    from srupp.models.backbones.transformer import Block
    from srupp.nn.srupp import SRUppAttention

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    matmul = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings)
    keys = mem_len + (unroll + 1) / 2
    widths = [m.linear1.out_features for m in model.modules() if isinstance(m, SRUppAttention)]
    widths += [m.proj.out_features for m in model.modules() if isinstance(m, Block)]
    return int(6 * matmul + sum(3 * 2 * 2 * keys * w for w in widths))
