"""Translation and classification through the one trainer and the CLI.

Tiny end-to-end runs of each task (train, then translate / classify / eval, and
the same from Python with srupp.inference),
exact resume after SIGKILL at a random moment, and the one-line errors for
bad input.
"""

import json
import random
import signal
import subprocess
import sys
import time

import pytest

from srupp.cli import main
from srupp.errors import UserError
from srupp.inference import checked_labels, classify_lines, load_run, predict, translate_lines
from srupp.train import Trainer, build_config

from lm_helpers import metrics

DE = "haus katze hund baum auto buch tisch stuhl fenster tuer".split()
EN = "house cat dog tree car book table chair window door".split()

# vocab 300: byte fallback's 256 byte pieces, <unk>, <eos>, the 21 letters and space, 20 merges
TRANSLATE = ["task=translate", "data.vocab_size=300", "model.d_model=16", "model.proj_size=8",
             "model.encoder_layers=1", "model.decoder_layers=1", "model.dropout=0.1",
             "train.max_tokens=128", "train.warmup_steps=3", "train.lr=1e-2",
             "train.log_every=2", "train.save_every=4", "train.eval_every=4",
             "train.eval_max_batches=2", "train.threads=1", "eval.beam=2",
             "eval.bleu_sentences=4", "eval.max_len_b=4", "data.test_size=8",
             "data.valid_size=8"]
CLASSIFY = ["task=classify", "model.d_model=16", "model.proj_size=8", "model.num_layers=1",
            "train.max_tokens=128", "train.warmup_steps=3", "train.lr=1e-2",
            "train.log_every=2", "train.save_every=4", "train.eval_every=4",
            "train.eval_max_batches=2", "train.threads=1", "data.test_size=10",
            "data.valid_size=10", "data.text=text", "data.label=label"]
KEYS = ("step", "train_loss", "lr", "valid_loss", "valid_bleu", "valid_chrf",
        "valid_accuracy", "valid_macro_f1")


def _write_tsv(path, header, rows):
    path.write_text("\t".join(header) + "\n" + "".join("\t".join(r) + "\n" for r in rows))
    return path


@pytest.fixture
def pairs(tmp_path):
    """A word-for-word German-to-English toy table."""
    rng = random.Random(1)
    rows = []
    for _ in range(120):
        idx = [rng.randrange(10) for _ in range(rng.randint(2, 5))]
        rows.append((" ".join(DE[i] for i in idx), " ".join(EN[i] for i in idx)))
    return _write_tsv(tmp_path / "pairs.tsv", ("de", "en"), rows)


@pytest.fixture
def texts(tmp_path):
    """Texts labelled by whether they name an animal."""
    rng = random.Random(2)
    rows = []
    for _ in range(120):
        idx = [rng.randrange(10) for _ in range(rng.randint(2, 6))]
        label = "animal" if {1, 2} & set(idx) else "thing"
        rows.append((" ".join(EN[i] for i in idx), label))
    return _write_tsv(tmp_path / "texts.tsv", ("text", "label"), rows)


def _run(capsys, *argv):
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _stdin(monkeypatch, tmp_path, text):
    f = tmp_path / "stdin.txt"
    f.write_text(text)
    handle = open(f)
    monkeypatch.setattr(sys, "stdin", handle)
    return handle


# --------------------------------------------------------------------------- end to end

def test_translation_end_to_end(tmp_path, pairs, capsys, monkeypatch):
    run = tmp_path / "run"
    rc, out, err = _run(capsys, "train", "--data", str(pairs), "--out", str(run),
                        "--no-progress", "--set", *TRANSLATE, "train.max_steps=8")
    assert rc == 0, err
    summary = json.loads(out)
    assert {"valid_loss", "valid_bleu", "valid_chrf"} <= set(summary)
    rows = metrics(run)
    assert all("valid_bleu" in r and "valid_chrf" in r for r in rows if "valid_loss" in r)
    # the final evaluation translates the whole validation split; the others a capped number
    assert [r["valid_sentences"] for r in rows if "valid_loss" in r] == [4, 4, 8]
    assert (run / "curves.png").exists()

    with _stdin(monkeypatch, tmp_path, "haus katze\n\nbuch tisch auto\n"):
        rc, out, err = _run(capsys, "translate", "--checkpoint", str(run), "--beam", "2")
    assert rc == 0, err
    lines = out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # one line out per line in
    assert json.loads(err.strip().splitlines()[-1])["sentences"] == 3
    # the command is srupp.inference's translate_lines, which Python calls the same way
    loaded = load_run(run)
    assert translate_lines(loaded.model, loaded.tokenizer, ["haus katze", "", "buch tisch auto"],
                           beam=2, max_len_b=4) == lines[:3]
    # the tokenizer has byte fallback: characters the data never had are bytes, not <unk>
    assert loaded.tokenizer.byte_fallback
    assert loaded.tokenizer.unk_id not in loaded.tokenizer.encode("¡haus â katze!").tolist()
    # --no-repeat-ngram-size is translate_lines' no_repeat_ngram_size
    with _stdin(monkeypatch, tmp_path, "haus katze\nbuch tisch auto\n"):
        rc, out, err = _run(capsys, "translate", "--checkpoint", str(run), "--beam", "2",
                            "--no-repeat-ngram-size", "1")
    assert rc == 0, err
    assert out.split("\n")[:2] == translate_lines(
        loaded.model, loaded.tokenizer, ["haus katze", "buch tisch auto"], beam=2,
        max_len_b=4, no_repeat_ngram_size=1)

    rc, out, err = _run(capsys, "eval", "--checkpoint", str(run), "--split", "test")
    assert rc == 0, err
    res = json.loads(out)
    assert {"bleu", "chrf", "signature", "tokens_per_s", "sentences"} <= set(res)
    assert res["sentences"] == 8 and res["signature"].startswith("nrefs:1")
    assert res["no_repeat_ngram_size"] == 0
    rc, out, err = _run(capsys, "eval", "--checkpoint", str(run), "--split", "test",
                        "--set", "eval.no_repeat_ngram_size=2")
    assert rc == 0, err
    assert json.loads(out)["no_repeat_ngram_size"] == 2


def test_a_vocabulary_too_small_for_byte_fallback_names_the_fix():
    with pytest.raises(UserError) as e:
        build_config(None, ["task=translate", "data.vocab_size=40"])
    message = str(e.value)
    assert message.startswith("data.vocab_size=40 is too small for sentencepiece's byte "
                              "fallback") and "set data.byte_fallback=false" in message
    assert not build_config(None, ["task=translate", "data.vocab_size=40",
                                   "data.byte_fallback=false"]).data.byte_fallback
    with pytest.raises(UserError, match="data.byte_fallback applies to the sentencepiece"):
        build_config(None, ["data.byte_fallback=false"])  # a byte-level LM
    # a saved run keeps its choice
    saved = build_config(None, ["task=translate", "data.vocab_size=40",
                                "data.byte_fallback=false"]).to_dict()
    assert not build_config(None, [], base=saved).data.byte_fallback


def test_classification_end_to_end(tmp_path, texts, capsys, monkeypatch):
    run = tmp_path / "run"
    rc, out, err = _run(capsys, "train", "--data", str(texts), "--out", str(run),
                        "--no-progress", "--set", *CLASSIFY, "train.max_steps=40",
                        "train.lr=3e-2", "model.pooling=max")
    assert rc == 0, err
    summary = json.loads(out)
    # whether an animal occurs: max pooling learns it in a few steps (the majority is 60%)
    assert summary["valid_accuracy"] >= 0.9
    assert json.loads((run / "labels.json").read_text()) == {"labels": ["animal", "thing"]}

    with _stdin(monkeypatch, tmp_path, "dog house\ntable chair\n\n"):
        rc, out, err = _run(capsys, "classify", "--checkpoint", str(run), "--top-k", "2")
    assert rc == 0, err
    got = [json.loads(ln) for ln in out.splitlines()]
    assert len(got) == 3
    assert all(set(g) == {"label", "prob", "top_k"} and len(g["top_k"]) == 2 for g in got)
    assert got[0]["top_k"][0][0] == got[0]["label"]
    assert abs(sum(p for _, p in got[0]["top_k"]) - 1) < 1e-4
    # from Python: srupp.inference's classify_lines, the same probabilities
    loaded = load_run(run)
    labels = checked_labels(loaded.checkpoint, loaded.model)
    probs = classify_lines(loaded.model, loaded.tokenizer, ["dog house", "table chair", ""])
    assert [labels[int(p.argmax())] for p in probs] == [g["label"] for g in got]
    assert [round(float(p.max()), 6) for p in probs] == [g["prob"] for g in got]

    rc, out, err = _run(capsys, "eval", "--checkpoint", str(run), "--split", "test")
    assert rc == 0, err
    res = json.loads(out)
    assert {"accuracy", "macro_f1", "loss"} <= set(res) and res["texts"] == 10


# --------------------------------------------------------------------------- resume

@pytest.mark.parametrize("task", ["translate", "classify"])
def test_sigkill_at_a_random_moment_then_resume_is_exact(tmp_path, pairs, texts, task):
    data, sets = (pairs, TRANSLATE) if task == "translate" else (texts, CLASSIFY)
    sets = [*sets, "train.max_steps=80", "train.eval_every=8", "train.save_every=8"]
    full = tmp_path / "full"
    Trainer(build_config(None, [*sets, f"data.corpus={data}"]), full, progress=False).train()

    # anywhere after the first checkpoint; a run that finished before the kill (a fast
    # machine) is tried again with a shorter wait, so that the kill lands mid-run
    for attempt in range(4):
        run = tmp_path / f"killed{attempt}"
        cmd = [sys.executable, "-m", "srupp.cli", "train", "--data", str(data), "--out",
               str(run), "--no-progress", "--set", *sets]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 120
            while not (run / "last.json").exists() and time.time() < deadline:
                time.sleep(0.005)
            time.sleep(random.uniform(0.0, 0.2 / 2 ** attempt))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        saved = json.loads((run / "last.json").read_text())["step"]
        if saved < 80:
            break
    assert saved < 80, "the kill should land mid-run"
    assert main(["train", "--out", str(run), "--resume", "--no-progress"]) == 0

    def strip(rows):
        return [{k: r[k] for k in KEYS if k in r} for r in rows]

    assert strip(metrics(run)) == strip(metrics(full))


# --------------------------------------------------------------------------- bad input

def _one_line_error(capsys, argv, match):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("srupp: error:"), err
    assert match in lines[0], lines[0]


def test_bad_tables_are_one_line_errors(tmp_path, capsys):
    ragged = tmp_path / "ragged.tsv"
    ragged.write_text("de\ten\nhaus\thouse\nkatze\n")
    empty_src = _write_tsv(tmp_path / "empty.tsv", ("de", "en"), [("haus", "house"), ("", "cat")])
    no_col = _write_tsv(tmp_path / "nocol.tsv", ("fr", "en"), [("maison", "house")])
    for path, match in ((ragged, "line 3"), (empty_src, "line 3"), (no_col, "'de'")):
        _one_line_error(capsys, ["train", "--data", str(path), "--out", str(tmp_path / "r"),
                                 "--no-progress", "--set", *TRANSLATE], match)
        assert not (tmp_path / "r").exists()  # nothing left behind


def test_a_type_that_does_not_apply_to_the_task(tmp_path, pairs, capsys):
    _one_line_error(capsys, ["train", "--data", str(pairs), "--out", str(tmp_path / "r"),
                             "--set", *TRANSLATE, "model.type=gru"], "gru")


def test_long_sources_error_or_are_cut_as_configured(tmp_path, pairs, capsys):
    sets = [*TRANSLATE, "train.max_steps=2", "data.max_len=4"]
    _one_line_error(capsys, ["train", "--data", str(pairs), "--out", str(tmp_path / "r"),
                             "--no-progress", "--set", *sets], "data.max_len=4")
    with pytest.warns(UserWarning, match=r"\d+ sentence\(s\) of the sources .* cut to"):
        Trainer(build_config(None, [*sets, "data.truncate=true", f"data.corpus={pairs}"]),
                tmp_path / "cut", progress=False)


def test_unseen_labels_and_a_checkpoint_of_another_task(tmp_path, texts, pairs, capsys,
                                                        monkeypatch):
    run = tmp_path / "run"
    assert _run(capsys, "train", "--data", str(texts), "--out", str(run), "--no-progress",
                "--set", *CLASSIFY, "train.max_steps=2")[0] == 0
    split = tmp_path / "split"
    split.mkdir()
    for name, label in (("train", "animal"), ("valid", "thing"), ("test", "plant")):
        _write_tsv(split / f"{name}.tsv", ("text", "label"), [("tree", label), ("dog", "animal")])
    _one_line_error(capsys, ["eval", "--checkpoint", str(run), "--data", str(split),
                             "--split", "test"], "known labels are animal, thing")
    with _stdin(monkeypatch, tmp_path, "haus\n"):
        _one_line_error(capsys, ["translate", "--checkpoint", str(run)],
                        "needs a translation checkpoint")
    _one_line_error(capsys, ["generate", "--checkpoint", str(run), "--prompt", "a"],
                    "srupp eval or classify")


def test_classification_needs_data(tmp_path, capsys):
    _one_line_error(capsys, ["train", "--out", str(tmp_path / "r"), "--set", *CLASSIFY],
                    "task=classify needs data")


def test_input_batches_from_a_pipe_keep_order_and_every_line():
    """Lines split across writes, CRLF, a last line without newline, batch caps."""
    import os
    import threading

    from srupp.cli import _input_batches

    r, w = os.pipe()
    chunks = [b"one\r\ntw", b"o\n\nthree\nfour\nfive\nsix", b"\nseven"]

    def writer():
        for c in chunks:
            os.write(w, c)
            time.sleep(0.05)  # the reader sees the lines in pieces, as from a terminal
        os.close(w)

    t = threading.Thread(target=writer)
    t.start()
    with open(r, "rb", buffering=0) as stream:
        batches = list(_input_batches(stream, 3))
    t.join()
    assert [ln for b in batches for ln in b] == ["one", "two", "", "three", "four", "five",
                                                 "six", "seven"]
    assert all(1 <= len(b) <= 3 for b in batches)
    assert batches[0] == ["one"]  # answered before the rest arrived


def test_a_long_source_to_translate_names_its_line(tmp_path, pairs, capsys, monkeypatch):
    run = tmp_path / "run"
    assert _run(capsys, "train", "--data", str(pairs), "--out", str(run), "--no-progress",
                "--set", *TRANSLATE, "train.max_steps=2")[0] == 0
    text = "haus\n" * 40 + " ".join(["katze"] * 300) + "\n"
    with _stdin(monkeypatch, tmp_path, text):
        _one_line_error(capsys, ["translate", "--checkpoint", str(run), "--batch-size", "8"],
                        "line 41 has")
    with _stdin(monkeypatch, tmp_path, text):
        rc, out, err = _run(capsys, "translate", "--checkpoint", str(run), "--truncate",
                            "--beam", "1")
    assert rc == 0 and len(out.split("\n")) == 42
    assert "srupp: warning: 1 sentence(s) of the input cut" in err


def test_accumulated_micro_batches_weigh_by_their_tokens(tmp_path, pairs):
    """grad_accum over sentence batches of different sizes = one batch holding them all."""
    import torch

    from srupp.data import LengthBatch
    from srupp.train.translate import PairBatch

    cfg = build_config(None, [*TRANSLATE, f"data.corpus={pairs}", "train.grad_accum=2",
                              "model.dropout=0", "train.grad_clip=0"])
    tr = Trainer(cfg, tmp_path / "r", progress=False)
    model, pairs_ = tr.model, tr.task.train_pairs
    b = PairBatch([pairs_[i] for i in range(4)], tr.device)
    model.zero_grad()
    model(b.src, b.tgt_in, src_pad=b.src_pad, tgt_pad=b.tgt_pad, targets=b.targets,
          label_smoothing=0.1).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    seen = {}
    real_step = tr.scaler.step

    def step(optimizer):  # the step's gradients, before the update
        seen.update({n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None})
        return real_step(optimizer)

    tr.scaler.step = step
    tr._train_step(iter([LengthBatch([0, 1, 2], 0, True), LengthBatch([3], 0, False)]))
    assert seen.keys() == expected.keys()
    for n in expected:
        torch.testing.assert_close(seen[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


def test_an_empty_validation_split_stops_before_training(tmp_path, pairs, capsys):
    _one_line_error(capsys, ["train", "--data", str(pairs), "--out", str(tmp_path / "r"),
                             "--set", *TRANSLATE, "data.valid_size=0"],
                    "the valid split of")


def test_no_texts_to_classify_and_an_empty_test_split(tmp_path, texts, capsys):
    """No lines give no probabilities; eval of an empty split is one line and exit 2."""
    run = tmp_path / "run"
    rc, out, err = _run(capsys, "train", "--data", str(texts), "--out", str(run),
                        "--no-progress", "--set", *CLASSIFY, "train.max_steps=2",
                        "data.test_size=0")
    assert rc == 0, err
    loaded = load_run(run)
    assert classify_lines(loaded.model, loaded.tokenizer, []).shape == (0, 2)
    assert predict(loaded.model, []).shape == (0, 2)
    _one_line_error(capsys, ["eval", "--checkpoint", str(run), "--split", "test"],
                    "the test split of")


def test_resume_refuses_other_data_of_the_same_lengths(tmp_path, texts, capsys):
    run = tmp_path / "run"
    assert _run(capsys, "train", "--data", str(texts), "--out", str(run), "--no-progress",
                "--set", *CLASSIFY, "train.max_steps=4")[0] == 0
    rows = [ln.split("\t") for ln in texts.read_text().splitlines()[1:]]
    flipped = [(t, {"animal": "thing", "thing": "animal"}[y]) for t, y in rows]
    _write_tsv(texts, ("text", "label"), flipped)  # the same texts, other labels
    _one_line_error(capsys, ["train", "--out", str(run), "--resume", "--no-progress",
                             "--set", "train.max_steps=8"], "content_crc32")


def test_the_best_checkpoint_has_the_best_metric_not_the_lowest_loss(tmp_path, texts,
                                                                      monkeypatch):
    """Classification: macro-F1 picks the best checkpoint; its loss may be higher."""
    results = iter([(0.5, 0.6), (0.9, 0.8), (0.4, 0.7)])  # (loss, macro-F1) at steps 4, 8, 8

    def validate(self, max_batches=None, *, final=False):
        loss, f1 = next(results)
        return {"loss": loss, "accuracy": f1, "macro_f1": f1}

    monkeypatch.setattr(Trainer, "validate", validate)
    run = tmp_path / "run"
    Trainer(build_config(None, [*CLASSIFY, f"data.corpus={texts}", "train.max_steps=8"]), run,
            progress=False).train()
    best = json.loads((run / "best.json").read_text())
    assert best["step"] == 8 and best["valid_macro_f1"] == 0.8
