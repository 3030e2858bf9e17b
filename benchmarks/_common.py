"""Helpers shared by the benchmark scripts (each script puts this folder on sys.path
by being run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Optional


def _is_cuda(device) -> bool:
    return device is not None and str(device).startswith("cuda")


def synchronize(device=None) -> None:
    """Wait for the work queued on ``device``: CUDA runs asynchronously, so a clock
    read before this measures the launches only. Nothing to wait for elsewhere."""
    if _is_cuda(device):
        import torch

        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], reps: int, warmup: int = 1,
                     device=None) -> float:
    """Mean wall seconds of ``fn()`` over ``reps`` calls, after ``warmup`` untimed calls
    (first-use compilation, allocator); on a CUDA ``device``, its work included."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / reps


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                   device=None) -> float:
    """Median seconds of one ``fn()`` call over ``repeats`` timed calls, after
    ``warmup`` untimed ones: for short calls whose outliers (a page fault, another
    process) a mean would absorb. The host's clock, or on a CUDA ``device`` CUDA
    events around each call (the device's time for the work the call queued)."""
    for _ in range(warmup):
        fn()
    times = []
    if _is_cuda(device):
        import torch

        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # (elapsed_time: milliseconds)
        return statistics.median(times)
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine's architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def compiler_errors(message: str, most: int = 12) -> str:
    """The lines of a failed build's log that say why (nvcc's and g++'s ``error``
    lines), and its last line; the log's tail alone is ninja's "build stopped"."""
    lines = message.splitlines()
    why = [ln.strip()[:400] for ln in lines if re.search(r"\berror\b", ln, re.I)
           and "build stopped" not in ln][:most]
    last = [ln.strip() for ln in lines[-1:] if ln.strip() not in why]
    return "\n".join(why + last)[:4000]


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


def layer_model_and_input(args, device="cpu", num_layers: int = 2):
    """The layer benchmark's model and input, from ``add_layer_shape_args``'s arguments:
    a seeded causal SRU++ of ``num_layers`` and a time-major input x (L, B, d), made
    on the CPU (the same numbers on every device) and moved to ``device``."""
    import torch

    from srupp.nn import SRUpp

    torch.manual_seed(0)
    model = SRUpp(args.d, args.d, args.proj, num_layers=num_layers, causal=True)
    return model.to(device), torch.randn(args.L, args.B, args.d).to(device)


def layer_training_step(model, x, bf16: bool) -> Callable[[], None]:
    """One forward and backward of ``model`` on ``x`` (fp32, or under bf16 autocast on
    x's device); the loss is the output's sum."""
    import torch

    def run():
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            out, _ = model(x)
        out.float().sum().backward()
    return run


def causal_mask(L: int, device="cpu"):
    """The additive causal mask (L, L) that the reference and ``nn.TransformerEncoder``
    are called with (srupp builds its own from ``causal=True``: same computation)."""
    import torch

    return torch.triu(torch.full((L, L), float("-inf"), device=device), diagonal=1)


def reference_layer(args, device="cpu", num_layers: int = 2):
    """``sru==3.0.0.dev6``'s SRUpp at the layer benchmark's shape on ``device``; raises
    ImportError when it is not installed, and RuntimeError with the compiler's errors
    when the CUDA kernel it builds on import did not compile for a CUDA ``device``."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import sru
    failed = [str(w.message) for w in caught if "unsuccessful" in str(w.message)]
    if failed and _is_cuda(device):
        raise RuntimeError("the reference's CUDA kernel did not compile:\n"
                           + compiler_errors(failed[0]))
    return sru.SRUpp(args.d, args.d, args.proj, num_layers=num_layers).to(device)


def reference_call(ref, x, causal, train: bool, bf16: bool = False) -> Callable[[], None]:
    """The reference's training step (forward and backward of the output's sum) or,
    with ``train=False``, its inference under ``no_grad``; fp32, or under bf16
    autocast; its warnings silenced."""
    import warnings

    import torch

    def run():
        with warnings.catch_warnings(), torch.set_grad_enabled(train), \
                torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            warnings.simplefilter("ignore")
            h = ref(x, attn_mask=causal)[0]
        if train:
            h.float().sum().backward()
    return run


def lm_training_step(cfg, vocab: int, bf16: bool, *, compiled: bool = False,
                     optimizer_range: Optional[str] = None, device="cpu"):
    """(step, model): ``cfg``'s language model on random tokens: forward under the
    precision, backward, clip, RAdam step, state carried from step to step.

    ``compiled`` runs the forward through ``torch.compile``; ``optimizer_range``
    names a profiler range around the clip and the optimizer step. The model and
    the tokens are made on the CPU (the same on every device), then moved to
    ``device``.
    """
    import contextlib

    import torch
    from torch.profiler import record_function

    from srupp.models import build_model

    torch.manual_seed(0)
    model = build_model(cfg.model_config(vocab)).to(device)
    model.train()
    t = cfg.train
    opt = torch.optim.RAdam(model.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                            decoupled_weight_decay=True)
    forward = torch.compile(model) if compiled else model
    B, L = t.batch_size, t.unroll
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (B, L + 1), generator=g).to(device) for _ in range(4)]
    state, i = None, 0

    def step():
        nonlocal state, i
        b = batches[i % len(batches)]
        i += 1
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
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


def bf16_gemm_peak(seconds: float = 2.0) -> float:
    """GFLOP/s of a large bf16 matrix product on this CPU (the best of a few rounds): the
    compute bound that decoding's products are measured against."""
    import torch

    n = 2048
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best
