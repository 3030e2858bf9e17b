"""Hugging Face transformers (srupp.hf): generate() on the recurrent state, Auto classes,
padded batches, export, pipeline."""

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face integration needs transformers: "
                                           "pip install 'srupp[hf]'")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from srupp.data import build_tokenizer  # noqa: E402
from srupp.hf import (SRUppCache, SRUppForCausalLM, SRUppHFConfig, SRUppTokenizer,  # noqa: E402
                      export_run_to_hf)
from srupp.models import CausalLM, build_model  # noqa: E402
from srupp.models.config import (GRUConfig, LSTMConfig, SRUConfig, SRUppConfig,  # noqa: E402
                                 TransformerConfig)

from lm_helpers import TEXT, config  # noqa: E402
from tolerances import half_dtypes  # noqa: E402

V = 32


def tiny(device=None, **kw):
    """A small SRU++ language model in eval mode whose attention has a say, built on the CPU
    (the same weights whatever the device) and moved to ``device``."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, d_model=16, proj_size=8, num_layers=2, dropout=0.0, mem_len=64)
    cfg.update(kw)
    m = CausalLM(SRUppConfig(**cfg)).eval()
    with torch.no_grad():  # α starts at 0, which would leave attention out
        for layer in m.backbone.rnn.layers:
            layer.transform.alpha.fill_(0.7)
    return m.to(device)


def baseline(kind, device=None):
    torch.manual_seed(0)
    shape = dict(vocab_size=V, d_model=16, num_layers=2, dropout=0.0)
    if kind == "transformer":
        return build_model(TransformerConfig(num_heads=2, **shape)).eval().to(device)
    config_class = {"sru": SRUConfig, "lstm": LSTMConfig, "gru": GRUConfig}[kind]
    return build_model(config_class(**shape)).eval().to(device)


def left_pad(prompts, device=None):
    """(ids, attention_mask) for a batch of prompts, left-padded as generate() wants them."""
    n = max(map(len, prompts))
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, n - len(p):] = torch.tensor(p)
        mask[b, n - len(p):] = 1
    return ids.to(device), mask.to(device)


def record_lengths(hf):
    """The input length of every forward call hf makes (from now on)."""
    lengths = []
    hf.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True)
    return lengths


@pytest.mark.parametrize("kind", ["srupp", "sru", "lstm", "gru", "transformer"])
def test_greedy_generate_matches_srupps_own_decoding_one_token_per_step(kind, device):
    m = tiny(device) if kind == "srupp" else baseline(kind, device)
    hf = SRUppForCausalLM.from_srupp(m)
    assert next(hf.parameters()).device == next(m.parameters()).device
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    want = m.generate(prompts, 8, temperature=0)
    ids, mask = left_pad(prompts, device)
    lengths = record_lengths(hf)
    got = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert got[:, ids.shape[1]:].tolist() == want
    # the prompt once, then only the new token with the state: the prefix is never recomputed
    assert lengths == [ids.shape[1]] + [1] * 7
    # a single prompt without a mask
    assert hf.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=8,
                       do_sample=False)[0, 5:].tolist() == want[0]
    if kind == "srupp":  # and in half precision: the copy keeps the weights' dtype
        for dtype in half_dtypes(device):
            half = tiny(device).to(dtype)
            hf = SRUppForCausalLM.from_srupp(half)
            assert next(hf.parameters()).dtype == dtype
            got = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
            assert got[:, ids.shape[1]:].tolist() == half.generate(prompts, 8, temperature=0)


def reference_beam_search(m, prompt, beams, n):
    """Beam search that reruns the whole sequence of every hypothesis at every step.

    Each step extends every live hypothesis by every token, scores them by the
    sum of their fp32 log-probabilities and keeps the ``beams`` best; it starts
    from the prompt alone. Without EOS, every hypothesis has the same length,
    so transformers' length penalty does not change the ranking.
    """
    hyps = [(torch.zeros(()), list(prompt))]
    for _ in range(n):
        candidates = []
        for score, seq in hyps:
            logp = m(torch.tensor([seq], device=m.device)).logits[0, -1].float().log_softmax(-1)
            candidates += [(s, seq + [t]) for t, s in enumerate(logp + score)]
        candidates.sort(key=lambda c: float(c[0]), reverse=True)
        hyps = candidates[:beams]
    return hyps[0][1][len(prompt):]


def test_beam_search_matches_a_reference_that_recomputes_every_prefix(device):
    m = tiny(device)
    hf = SRUppForCausalLM.from_srupp(m)
    prompt = [3, 1, 4, 1, 5]
    lengths = record_lengths(hf)
    got = hf.generate(torch.tensor([prompt], device=device), num_beams=2, do_sample=False,
                      max_new_tokens=6)
    with torch.no_grad():
        want = reference_beam_search(m, prompt, 2, 6)
    assert got[0, len(prompt):].tolist() == want
    # both beams read the prompt once; after that, one token each, the state reordered
    assert lengths == [len(prompt)] + [1] * 5


def test_sampling_is_reproducible_with_a_seed(device):
    hf = SRUppForCausalLM.from_srupp(tiny(device))
    x = torch.tensor([[3, 1, 4]], device=device)

    def draw():
        torch.manual_seed(7)  # seeds the CPU's and every GPU's generator
        return hf.generate(x, do_sample=True, top_k=10, temperature=1.5, max_new_tokens=12,
                           num_return_sequences=3)

    first = draw()
    assert first.shape == (3, 15)
    assert torch.equal(first, draw())
    assert len({tuple(row) for row in first[:, 3:].tolist()}) > 1  # it did sample


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True},
                                {"tie_embeddings": True, "adaptive_cutoffs": [8, 16],
                                 "div_val": 2}],
                         ids=["untied", "tied", "adaptive-tied"])
def test_save_pretrained_and_auto_from_pretrained_give_identical_logits(tmp_path, kw, device):
    from safetensors import safe_open

    hf = SRUppForCausalLM.from_srupp(tiny(device, **kw))  # saved from the device
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)  # no trust_remote_code
    assert type(loaded) is SRUppForCausalLM
    assert type(AutoConfig.from_pretrained(tmp_path)) is SRUppHFConfig
    assert loaded.config.srupp == hf.config.srupp and not loaded.training
    loaded.to(device)  # loaded onto the CPU, then moved: ties and cluster bounds follow
    x = torch.randint(0, V, (2, 7)).to(device)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, hf(x).logits, rtol=0, atol=0)
    # each tied tensor is stored once, under its first name
    assert saved == set(hf.state_dict()) - set(hf.all_tied_weights_keys)
    out = loaded.model.output
    if not kw:
        assert "model.output.weight" in saved
    elif "adaptive_cutoffs" in kw:  # stored once, tied again on loading
        emb = loaded.model.embedding
        assert all(o is e.weight for o, e in zip(out.out_embs, emb.emb_layers))
        assert not any(k.startswith("model.output.out_embs") for k in saved)
    else:
        assert out.weight is loaded.model.embedding.weight
        assert "model.output.weight" not in saved


def test_labels_give_the_next_token_loss_and_a_foreign_cache_is_refused(device):
    m = tiny(device)
    hf = SRUppForCausalLM.from_srupp(m)
    x = torch.randint(0, V, (2, 9)).to(device)
    out = hf(x, labels=x)
    targets = torch.cat([x[:, 1:], torch.full((2, 1), -100, device=device)], 1)
    torch.testing.assert_close(out.loss, m(x, targets=targets).loss)
    # transformers 5.24 renamed the state's field and argument past_key_values -> cache
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    assert isinstance(cache, SRUppCache)
    assert cache.get_seq_length() == 9
    for name in ("past_key_values", "cache"):
        with pytest.raises(TypeError, match="SRUppCache"):
            hf(x, **{name: (torch.zeros(1),)})
    with pytest.raises(ValueError, match="not both"):
        hf(x, past_key_values=cache, cache=cache)


@pytest.mark.parametrize("kind", ["byte", "char", "word", "sentencepiece"])
def test_tokenizer_keeps_srupps_ids_and_text_through_auto_tokenizer(tmp_path, kind):
    options = {}
    if kind == "sentencepiece":
        pytest.importorskip("sentencepiece", reason="needs sentencepiece: pip install "
                                                    "'srupp[subword]'")
        options = {"vocab_size": 300, "model_type": "bpe"}  # byte fallback: "é" as bytes
    tok = build_tokenizer(kind, TEXT * 20, **options)
    SRUppTokenizer(srupp_tokenizer=tok).save_pretrained(tmp_path)
    SRUppHFConfig(srupp=SRUppConfig(vocab_size=tok.vocab_size).to_dict()).save_pretrained(tmp_path)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert type(hf_tok) is SRUppTokenizer and hf_tok.vocab_size == tok.vocab_size
    text = "When in the chronicle, héllo\nI see fairest wights"
    ids = tok.encode(text).tolist()
    assert hf_tok(text)["input_ids"] == ids
    assert hf_tok.decode(ids) == tok.decode(ids)
    assert len(set(hf_tok.convert_ids_to_tokens(list(range(tok.vocab_size))))) == tok.vocab_size
    # a pad token, id 0, that adds nothing to the vocabulary; text that spells it is text
    assert hf_tok.pad_token_id == 0 and len(hf_tok) == tok.vocab_size
    assert hf_tok.padding_side == "left"
    assert hf_tok(hf_tok.pad_token + text)["input_ids"] == tok.encode(hf_tok.pad_token
                                                                      + text).tolist()


@pytest.mark.parametrize("kind", ["byte", "word"])
def test_left_padded_batched_generate_equals_each_prompt_alone(tmp_path, kind, device):
    tok = build_tokenizer(kind, TEXT * 20)
    hf = SRUppForCausalLM.from_srupp(tiny(device, vocab_size=tok.vocab_size))
    SRUppTokenizer(srupp_tokenizer=tok).save_pretrained(tmp_path)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)  # the pad token survives saving
    assert hf_tok.pad_token_id == hf.config.pad_token_id == hf.generation_config.pad_token_id
    prompts = ["When in the chronicle", "I see", "And beauty making beautiful old rhyme"]
    batch = hf_tok(prompts, padding=True, padding_side="left", return_tensors="pt").to(device)
    assert (batch["attention_mask"] == 0).any()  # the prompts have different lengths
    got = hf.generate(**batch, max_new_tokens=8, do_sample=False)
    for row, prompt in zip(got, prompts):
        alone = hf_tok(prompt, return_tensors="pt").to(device)
        want = hf.generate(**alone, max_new_tokens=8, do_sample=False)
        assert row[-8:].tolist() == want[0, -8:].tolist()
    # a prompt that holds the pad id without an attention_mask is all tokens, not padding
    ids = torch.tensor([[0, 3, 0, 4]], device=device)
    assert hf.generate(ids, max_new_tokens=8, do_sample=False).tolist() == \
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                    do_sample=False).tolist()


def test_exported_run_works_in_a_text_generation_pipeline(tmp_path, corpus):
    from transformers import pipeline

    from srupp.train import Trainer
    from srupp.inference import load_run

    run = tmp_path / "run"
    Trainer(config(corpus, "train.max_steps=4"), run, progress=False).train()
    out = tmp_path / "hf"
    export_run_to_hf(run, out)
    export_run_to_hf(run, out)  # an earlier export is replaced
    assert {"config.json", "model.safetensors", "srupp_tokenizer.json",
            "tokenizer_config.json", "README.md"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["model_type"] == "srupp"
    assert "import srupp.hf" in (out / "README.md").read_text()

    pipe = pipeline("text-generation", model=str(out))
    text = pipe("When in", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    _, tok, m, _ = load_run(run)
    new = m.generate([tok.encode("When in").tolist()], 6, temperature=0)[0]
    assert text == "When in" + tok.decode(new)

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        export_run_to_hf(run, tmp_path / "other")
    with pytest.raises(ValueError, match="holds no checkpoint"):
        export_run_to_hf(tmp_path / "other", tmp_path / "hf2")


@pytest.mark.parametrize("first", ["srupp", "transformers"])
def test_import_srupp_stays_light_and_import_srupp_hf_registers(first):
    """import srupp imports neither transformers nor the models, and registers nothing;
    import srupp.hf registers the Auto classes, whichever was imported first."""
    second = "transformers" if first == "srupp" else "srupp"
    code = (f"import sys\n"
            f"import {first}\n"
            f"if '{first}' == 'srupp':\n"
            f"    assert 'transformers' not in sys.modules, 'import srupp imported transformers'\n"
            f"    assert 'srupp.models' not in sys.modules\n"
            f"import {second}\n"
            f"from transformers import AutoConfig, AutoModelForCausalLM\n"
            f"try:\n"
            f"    AutoConfig.for_model('srupp')\n"
            f"except ValueError:\n"
            f"    pass\n"
            f"else:\n"
            f"    raise AssertionError('srupp registered without import srupp.hf')\n"
            f"import srupp.hf\n"
            f"config = AutoConfig.for_model('srupp')\n"
            f"model = AutoModelForCausalLM.from_config(config)\n"
            f"print(type(config).__name__, type(model).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["SRUppHFConfig", "SRUppForCausalLM"]


def test_without_transformers_the_module_names_the_extra_to_install(monkeypatch):
    import importlib

    from srupp._extras import MissingExtra

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    monkeypatch.delitem(sys.modules, "srupp.hf")
    with pytest.raises(MissingExtra, match=r"pip install 'srupp\[hf\]'"):
        importlib.import_module("srupp.hf")
