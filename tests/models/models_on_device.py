"""What the models tests share about the device they run on (``--device``).

Importable from the test files of tests/models (pytest puts their folder on
``sys.path``).
"""

import torch

from tolerances import tol


def across_shapes(device: torch.device, *, rtol: float, atol: float) -> dict:
    """``assert_close`` tolerances for two fp32 computations of differently shaped batches
    (a padded batch and each row alone, reordered rows and the rows run afresh).

    On the CPU, the tolerances given. On CUDA, at least tolerances.tol(float32):
    cuBLAS and the attention kernels choose their tiling (and split-K) by the shapes,
    so the same products are summed in another order for another batch size.
    """
    if device.type == "cpu":
        return dict(rtol=rtol, atol=atol)
    fp32 = tol(torch.float32)
    return dict(rtol=max(rtol, fp32["rtol"]), atol=max(atol, fp32["atol"]))


def generators(device: torch.device, seed: int):
    """Seeded generators to sample with: a CPU one (the usual, whatever the model's
    device) and, for a model on another device, one on that device too."""
    gens = [torch.Generator().manual_seed(seed)]
    if device.type != "cpu":
        gens.append(torch.Generator(device=device).manual_seed(seed))
    return gens
