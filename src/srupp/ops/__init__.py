"""Element-wise recurrence kernels.

``sru_recurrence`` is the one entry point the layers call. It dispatches to a
backend; today the only backend is the plain PyTorch reference in
:mod:`srupp.ops.reference`, which is also the oracle fast kernels are tested
against.
"""

from .reference import compute_dtype, sru_recurrence_reference

__all__ = ["sru_recurrence", "sru_recurrence_reference", "compute_dtype"]


def sru_recurrence(U, x, weight_c, bias, c0=None, *, scale_x=1.0, mask_pad=None,
                   dropout_mask=None, bidirectional=False):
    """Run the SRU recurrence on the best available backend.

    Same arguments, shapes and results as :func:`sru_recurrence_reference`:
    U (B, L, k, D), x (B, L, D) or None, weight_c and bias (2, D), c0 (B, D),
    mask_pad (B, L) bool, dropout_mask (B, D); returns h (B, L, D) and c_last (B, D).
    """
    return sru_recurrence_reference(
        U, x, weight_c, bias, c0, scale_x=scale_x, mask_pad=mask_pad,
        dropout_mask=dropout_mask, bidirectional=bidirectional,
    )
