"""train.compile: the compiled training forward takes the same steps as the eager one."""

import shutil

import pytest
import torch

from srupp.train import Trainer

from lm_helpers import config, metrics

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile on CPU needs a C++ compiler")


def test_compiled_training_equals_eager(tmp_path, corpus):
    runs = {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        cfg = config(corpus, "model.dropout=0", "train.max_steps=4", f"train.compile={flag}")
        trainer = Trainer(cfg, tmp_path / name, progress=False)
        trainer.train()
        runs[name] = trainer
    eager, compiled = runs["eager"], runs["compiled"]
    assert compiled.train_model is not compiled.model  # the forward really was compiled
    for (n, a), (_, b) in zip(eager.model.named_parameters(), compiled.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    losses = [[r["train_loss"] for r in metrics(tmp_path / n) if "train_loss" in r]
              for n in runs]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
