"""The models tests' settings: fp32 means IEEE fp32 on CUDA.

The agreement tests compare two fp32 computations of the same logits (step
against forward, a padded batch against each row alone) within 1e-5 or less.
On CUDA, cuDNN's RNNs (the LSTM and GRU models, encoders and classifiers) take
TF32 by default, which reads 10 bits of each fp32 mantissa: two paths would
then differ by ~1e-3. For the length of each test run with ``--device cuda``,
cuDNN and cuBLAS compute fp32 in IEEE fp32, and the previous settings are put
back afterwards. The fixture does not take ``device``, so it adds no test to
what ``--device cuda`` collects.
"""

import pytest
import torch


def _fp32_flags():
    """[(object, attribute, IEEE value)] of the settings that let fp32 work run in TF32.

    The legacy flags, which every torch reads (from 2.9 on, setting them sets the
    per-operator ``fp32_precision`` settings too). torch refuses to read them once they
    and the per-operator settings disagree (someone set the latter alone): then those.
    """
    backends = torch.backends
    try:
        backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32
    except RuntimeError:
        return [(backends.cuda.matmul, "fp32_precision", "ieee"),
                (backends.cudnn.conv, "fp32_precision", "ieee"),
                (backends.cudnn.rnn, "fp32_precision", "ieee")]
    return [(backends.cudnn, "allow_tf32", False), (backends.cuda.matmul, "allow_tf32", False)]


@pytest.fixture(autouse=True)
def ieee_fp32_on_cuda(request):
    if request.config.getoption("device") != "cuda" or not torch.cuda.is_available():
        yield
        return
    changed = []  # (object, attribute, value before)
    for obj, name, value in _fp32_flags():
        before = getattr(obj, name)
        if before != value:
            setattr(obj, name, value)
            changed.append((obj, name, before))
    try:
        yield
    finally:
        for obj, name, before in reversed(changed):
            setattr(obj, name, before)
