"""train.compile: the compiled training forward takes the same steps as the eager one.

On ``--device`` (``pytest --device cuda`` runs it on the GPU), where the
recurrence is the custom op around srupp's kernel (C++ on the CPU, Triton on
CUDA), which the compiled graph calls as one opaque op.
"""

import importlib.util
import shutil

import pytest
import torch

from srupp.train import Trainer

from lm_helpers import config, metrics
from tolerances import tol


def _skip_without_a_compiler(device):
    """torch.compile's inductor writes C++ for the CPU and Triton for CUDA."""
    if device.type == "cpu" and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler (g++ or c++ on PATH)")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        pytest.skip("torch.compile on CUDA needs Triton (pip install triton)")


def test_compiled_training_equals_eager(tmp_path, corpus, device):
    _skip_without_a_compiler(device)
    runs = {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        cfg = config(corpus, "model.dropout=0", "train.max_steps=4", f"train.compile={flag}",
                     f"train.device={device.type}")
        trainer = Trainer(cfg, tmp_path / name, progress=False)
        trainer.train()
        runs[name] = trainer
    eager, compiled = runs["eager"], runs["compiled"]
    assert compiled.train_model is not compiled.model  # the forward really was compiled
    assert next(compiled.model.parameters()).device.type == device.type
    # on the CPU the same sums in the same order; CUDA's fused kernels may add in another
    close = dict(rtol=1e-5, atol=1e-6) if device.type == "cpu" else tol(torch.float32)
    for (n, a), (_, b) in zip(eager.model.named_parameters(), compiled.model.named_parameters()):
        torch.testing.assert_close(a, b, **close, msg=n)
    losses = [[r["train_loss"] for r in metrics(tmp_path / n) if "train_loss" in r]
              for n in runs]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5 if device.type == "cpu" else 1e-4)
