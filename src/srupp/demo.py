"""``srupp demo``: one SRU++ layer's forward and backward on random data, timed.

A quick check that the layer and its kernels work on this machine: a 2-layer
causal SRU++ (d=256, d′=64) over a (128, 8, 256) input, printing the shapes
and the wall time of one forward and one backward pass. Run it with
``srupp demo`` or ``python -m srupp.demo``. (``make demo`` is something else: it
trains the ``shakespeare-cpu`` language-model recipe and samples from it.)
"""

from __future__ import annotations

import time


def main() -> None:
    import torch

    from srupp.nn import SRUpp

    torch.manual_seed(0)
    L, B, D = 128, 8, 256
    model = SRUpp(input_size=D, hidden_size=D, proj_size=64, num_layers=2, causal=True)
    x = torch.randn(L, B, D)

    t0 = time.perf_counter()
    output, state = model(x)
    t1 = time.perf_counter()
    output.sum().backward()
    t2 = time.perf_counter()

    print(f"input shape: {tuple(x.shape)}")
    print(f"output shape: {tuple(output.shape)}")
    print(f"state.c shape: {tuple(state.c.shape)}")
    print(f"forward: {(t1 - t0) * 1e3:.1f} ms")
    print(f"backward: {(t2 - t1) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
