"""Where training meets the device: waiting for it.

On CUDA the host only queues work; it waits for the GPU when it reads a
result (``.item()``, ``float(t)``, ``.tolist()``, ``.cpu()``) or copies from
pageable host memory. A training step that does neither lets the host
prepare the next step while the GPU runs this one; the trainer waits on
purpose only where it needs the time or a value (:func:`synchronize`).
"""

from __future__ import annotations

import torch


def synchronize(device) -> None:
    """Wait until ``device`` has run the work queued on it (nothing to wait for on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
