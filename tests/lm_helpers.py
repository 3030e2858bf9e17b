"""Helpers shared by the language-model, trainer and comparison tests.

Importable from any test file: pytest puts ``tests/`` (where conftest.py lives)
on ``sys.path``.
"""

import json

import torch

from srupp.models import CausalLM, SRUppConfig
from srupp.train import build_config

# a tiny corpus: four lines of a sonnet
TEXT = ("When in the chronicle of wasted time\nI see descriptions of the fairest wights,\n"
        "And beauty making beautiful old rhyme\nIn praise of ladies dead and lovely knights,\n")

# a model and run small enough for a few seconds of CPU
TINY_ANY = ["model.d_model=16", "model.num_layers=2", "model.dropout=0.1",
            "train.batch_size=2", "train.unroll=16", "train.warmup_steps=3", "train.lr=3e-3",
            "train.log_every=2", "train.save_every=4", "train.eval_every=4",
            "train.eval_max_batches=2", "eval.batch_size=2", "train.threads=1"]
TINY = TINY_ANY + ["model.proj_size=8"]  # an SRU++ model (the default model.type)


def config(corpus, *extra):
    """The TINY run config on ``corpus``, with extra ``key=value`` overrides."""
    return build_config(None, TINY + [f"data.corpus={corpus}", *extra])


def baseline_config(corpus, kind, *extra):
    """TINY for the baseline ``kind`` (model.type): two heads for a transformer."""
    heads = ["model.num_heads=2"] if kind == "transformer" else []
    return build_config(None, TINY_ANY + [f"data.corpus={corpus}", f"model.type={kind}",
                                          *heads, *extra])


def metrics(run):
    """The rows of a run's metrics.jsonl."""
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def greedy_by_recomputing(m, prompt, n):
    """The slow way to decode: rerun the whole sequence for every new token (on m's device)."""
    seq, device = list(prompt), next(m.parameters()).device
    for _ in range(n):
        seq.append(int(m(torch.tensor([seq], device=device)).logits[0, -1].argmax()))
    return seq[len(prompt):]


def one_line_error(capsys, args):
    """Run the CLI on ``args``: it must exit 2 with one ``srupp: error:`` line, no traceback."""
    from srupp.cli import main

    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("srupp: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def tiny_srupp_lm(device=None, **kw):
    """A tiny SRU++ language model in eval mode whose attention has a say (α starts at 0),
    built on the CPU (the same weights whatever the device), then moved to ``device``."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=11, d_model=8, proj_size=4, num_layers=2, dropout=0.0, mem_len=64)
    cfg.update(kw)
    m = CausalLM(SRUppConfig(**cfg)).eval()
    with torch.no_grad():
        for layer in m.backbone.rnn.layers:
            if layer.use_attention:
                layer.transform.alpha.fill_(0.7)
    return m.to(device)
