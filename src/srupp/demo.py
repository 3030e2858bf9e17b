"""Tiny SRU++ demo: one forward/backward pass on random data, with timings.

Run with ``python -m srupp.demo`` (or ``make demo`` / ``srupp demo``).
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
