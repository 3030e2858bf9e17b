"""The int8 flags of the CLI: generate --dtype int8, eval --dtype, export --quantize int8."""

import json

import pytest
import torch

from srupp.cli import main
from srupp.models import CausalLM, SRUppConfig
from srupp.ops.settings import cpu_has_native_bf16

from lm_helpers import TEXT


@pytest.fixture
def ckpt(tmp_path):
    """A checkpoint folder of an untrained byte-level SRU++ model, and a corpus file."""
    torch.manual_seed(0)
    folder = tmp_path / "ckpt"
    CausalLM(SRUppConfig(vocab_size=256, d_model=16, proj_size=8, num_layers=2,
                         dropout=0.0, mem_len=16)).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps({"type": "byte"}))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 20)
    return folder, corpus


def test_generate_int8_names_its_activations(ckpt, capsys):
    folder, _ = ckpt
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "When",
                 "--max-new-tokens", "5", "--temperature", "0", "--dtype", "int8"]) == 0
    info = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert info["dtype"] == "int8" and info["new_tokens"] == 5
    assert info["activations"] == ("bf16" if cpu_has_native_bf16() else "fp32")


def test_eval_dtypes_give_close_scores(ckpt, capsys):
    folder, corpus = ckpt
    scores = {}
    for dtype in ("fp32", "bf16", "int8", "w8a8"):
        assert main(["eval", "--checkpoint", str(folder), "--data", str(corpus),
                     "--dtype", dtype, "--set", "eval.batch_size=2", "train.unroll=16"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["dtype"] == dtype
        assert out["activations"] == ("bf16" if dtype == "bf16" else "fp32")
        scores[dtype] = out["bpc"]
    # an untrained model scores ~8 bits per byte; its weights' rounding moves that by little
    assert abs(scores["int8"] - scores["fp32"]) < 0.05, scores
    assert abs(scores["w8a8"] - scores["fp32"]) < 0.05, scores
    assert abs(scores["bf16"] - scores["fp32"]) < 0.05, scores


def test_export_quantize_int8_writes_int8_graphs(ckpt, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    folder, _ = ckpt
    out = tmp_path / "onnx"
    assert main(["export", "--checkpoint", str(folder), "--out", str(out),
                 "--quantize", "int8"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == "int8"
    assert json.loads((out / "srupp-onnx.json").read_text())["weights"] == "int8"
