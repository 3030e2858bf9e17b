"""The layers' kernels: the SRU recurrence, the projections and the attention.

``sru_recurrence`` is the one entry point for the recurrence. It checks its
arguments once (all backends reject the same bad input with the same
ValueError / TypeError), then runs a backend:

``"reference"``
    :func:`sru_recurrence_reference`, the plain PyTorch loop over time (the
    oracle the fast kernels are tested against; autograd does its backward).
``"cpu"``
    the fused, multithreaded, vectorised C++ kernel (:mod:`srupp.ops.cpu_kernels`),
    compiled on first use, for CPU tensors in float32 / bfloat16.
``"triton"``
    Triton kernels (``srupp.ops.triton_kernel``, imported lazily) for CUDA tensors,
    and for CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``, how
    the tests run them).
``"auto"`` (default)
    the fast kernel for the tensors' device when it applies and is available
    (CPU -> "cpu", CUDA -> "triton"), else the reference. float64 inputs (gradcheck)
    and other devices always use the reference. If the C++ build fails, one warning
    is given and the reference is used from then on.

Both fast backends run through the same ``torch.library`` custom ops and autograd,
``srupp::sru_fwd`` / ``srupp::sru_bwd`` (:mod:`srupp.ops.recurrence`), which work
under ``torch.compile(fullgraph=True)``.

Choose a backend with :func:`set_backend`, temporarily with :func:`use_backend`,
or for a whole process with ``SRUPP_BACKEND``. A forced "cpu" or "triton"
backend raises if it can't run the given tensors (wrong device, or the kernel is
unavailable), except that float64 inputs still go to the reference.

Around the recurrence, the layers' projections and attention have their own
fast paths with plain references beside them: :mod:`srupp.ops.matmul`
(``linear``: oneDNN for large fp32 CPU products) and :mod:`srupp.ops.attention`
(``attend``: explicit bf16 matrix products on CPU for short windows), and
:mod:`srupp.ops.quant` (``linear_int8``: int8 weights for decoding), and
:mod:`srupp.ops.layer_step` runs one SRU++ layer's decoding step as one C++ op
(``layer_step``, beside its plain reference). One settings object,
:func:`backends`, holds the four choices, and its sibling :func:`tuning` the
kernels' and the decoding loop's numbers (:mod:`srupp.ops.settings`).
"""

from __future__ import annotations

from . import cpu_kernels
from .matmul import (get_matmul_backend, linear, linear_onednn, linear_reference,
                     set_matmul_backend, use_matmul_backend)
from .recurrence import (BACKENDS, get_backend, set_backend, sru_bwd, sru_fwd, sru_recurrence,
                         use_backend, warm_up)
from .reference import compute_dtype, sru_recurrence_reference
from .attention import (attend, attention_causal_matmul, attention_matmul, attention_reference,
                        get_attention_backend, set_attention_backend, use_attention_backend)
from .settings import Backends, Tuning, backends, cpu_has_native_bf16, tuning
from .quant import dequantize, linear_int8, linear_int8_reference, quantize_per_channel
from .layer_step import (get_step_backend, layer_step, layer_step_reference, set_step_backend,
                         use_step_backend)

__all__ = [
    "sru_recurrence", "sru_recurrence_reference", "compute_dtype", "warm_up",
    "set_backend", "get_backend", "use_backend", "BACKENDS", "backends", "Backends",
    "tuning", "Tuning",
    "linear", "linear_reference", "linear_onednn",
    "set_matmul_backend", "get_matmul_backend", "use_matmul_backend",
    "attend", "attention_reference", "attention_matmul", "attention_causal_matmul",
    "set_attention_backend", "get_attention_backend", "use_attention_backend",
    "cpu_has_native_bf16",
    "quantize_per_channel", "dequantize", "linear_int8", "linear_int8_reference",
    "layer_step", "layer_step_reference", "set_step_backend", "get_step_backend",
    "use_step_backend",
]
