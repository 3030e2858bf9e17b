"""Where training meets the device: batches moved to it, and waiting for it.

On CUDA the host only queues work; it waits for the GPU when it reads a
result (``.item()``, ``float(t)``, ``.tolist()``, ``.cpu()``) or copies from
pageable host memory. A training step that does neither lets the host
prepare the next step while the GPU runs this one; the trainer waits on
purpose only where it needs the time or a value (:func:`synchronize`).
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t``, a batch built on the host, on ``device``.

    To CUDA the copy goes from pinned (page-locked) memory and does not block:
    from pageable memory CUDA first waits for the device. Pinning copies ``t``
    once more on the host, which is cheap for batches of token ids; the pinned
    buffer is kept by PyTorch's host allocator until the copy has run. Any
    other target is a plain ``t.to(device)``.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def synchronize(device) -> None:
    """Wait until ``device`` has run the work queued on it (nothing to wait for on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
