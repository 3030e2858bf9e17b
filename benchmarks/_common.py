"""Helpers shared by the benchmark scripts (each script puts this folder on sys.path
by being run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

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


def bare_training_step(trainer, grad_clip: Optional[float] = None) -> Callable[[], None]:
    """One training step of ``trainer``'s model and data without the trainer around it.

    Forward under the run's precision, backward, optional gradient clipping,
    optimiser step; the recurrent state is carried (detached) from step to step.
    """
    import torch

    from srupp.train.evaluate import autocast_context

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
