"""One registry of model types: configs per type, saving and loading, old saves, counts."""

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

import srupp.models.base as base
from srupp.errors import UserError
from srupp.models import (MODELS, CausalLM, GRUConfig, LanguageModel, LSTMConfig, SRUConfig,
                          SRUppConfig, TransformerConfig, build_model, config_from_dict,
                          load_model, parameter_counts)
from srupp.models.baselines import SRULanguageModel, TransformerLanguageModel

# What config.json held before the per-type configs: asdict of the one flat LMConfig, every
# field of every type written out (made with the code of commit 0e9608f). The gru one has
# proj_size and num_heads that its model never read, as the old `srupp compare` wrote them.
OLD = {
    "srupp": '{"vocab_size": 11, "d_model": 8, "proj_size": 4, "num_layers": 2, "num_heads": 1, "dropout": 0.0, "emb_dropout": null, "attn_dropout": 0.0, "highway_bias": -2.0, "attention_every_n_layers": 1, "attention_last_n_layers": -1, "mem_len": 64, "tie_embeddings": false, "layer_norm": false, "normalize_after": false, "adaptive_cutoffs": null, "div_val": 4, "emb_dim": null, "tie_projections": true, "type": "srupp", "projection_size": 0, "positions": null, "max_positions": 2048, "ffn_mult": 4}',  # noqa: E501
    "sru": '{"vocab_size": 11, "d_model": 8, "proj_size": 4, "num_layers": 2, "num_heads": 1, "dropout": 0.1, "emb_dropout": null, "attn_dropout": 0.0, "highway_bias": -2.0, "attention_every_n_layers": 1, "attention_last_n_layers": -1, "mem_len": 16, "tie_embeddings": false, "layer_norm": true, "normalize_after": false, "adaptive_cutoffs": null, "div_val": 4, "emb_dim": null, "tie_projections": true, "type": "sru", "projection_size": 4, "positions": null, "max_positions": 2048, "ffn_mult": 4}',  # noqa: E501
    "lstm": '{"vocab_size": 11, "d_model": 8, "proj_size": 64, "num_layers": 2, "num_heads": 1, "dropout": 0.1, "emb_dropout": null, "attn_dropout": 0.0, "highway_bias": -2.0, "attention_every_n_layers": 1, "attention_last_n_layers": -1, "mem_len": 16, "tie_embeddings": false, "layer_norm": false, "normalize_after": false, "adaptive_cutoffs": null, "div_val": 4, "emb_dim": null, "tie_projections": true, "type": "lstm", "projection_size": 0, "positions": null, "max_positions": 2048, "ffn_mult": 4}',  # noqa: E501
    "gru": '{"vocab_size": 11, "d_model": 8, "proj_size": 2, "num_layers": 2, "num_heads": 2, "dropout": 0.1, "emb_dropout": null, "attn_dropout": 0.0, "highway_bias": -2.0, "attention_every_n_layers": 1, "attention_last_n_layers": -1, "mem_len": 16, "tie_embeddings": false, "layer_norm": false, "normalize_after": false, "adaptive_cutoffs": null, "div_val": 4, "emb_dim": null, "tie_projections": true, "type": "gru", "projection_size": 0, "positions": null, "max_positions": 2048, "ffn_mult": 4}',  # noqa: E501
    "transformer": '{"vocab_size": 11, "d_model": 8, "proj_size": 64, "num_layers": 2, "num_heads": 2, "dropout": 0.1, "emb_dropout": null, "attn_dropout": 0.0, "highway_bias": -2.0, "attention_every_n_layers": 1, "attention_last_n_layers": -1, "mem_len": 0, "tie_embeddings": false, "layer_norm": false, "normalize_after": false, "adaptive_cutoffs": null, "div_val": 4, "emb_dim": null, "tie_projections": true, "type": "transformer", "projection_size": 0, "positions": null, "max_positions": 32, "ffn_mult": 2}',  # noqa: E501
}
SHARED = dict(vocab_size=11, d_model=8, num_layers=2, mem_len=16)
EXPECTED = {
    "srupp": SRUppConfig(**{**SHARED, "proj_size": 4, "dropout": 0.0, "mem_len": 64}),
    "sru": SRUConfig(**SHARED, projection_size=4, layer_norm=True),
    "lstm": LSTMConfig(**SHARED),
    "gru": GRUConfig(**SHARED),
    "transformer": TransformerConfig(**{**SHARED, "mem_len": 0}, num_heads=2,
                                     max_positions=32, ffn_mult=2),
}


def test_one_registry_of_configs_and_models():
    assert list(MODELS) == ["srupp", "sru", "lstm", "gru", "transformer"]
    for kind, (config_class, model_class) in MODELS.items():
        assert config_class.type == kind and model_class.config_class is config_class
        assert type(build_model({"type": kind})) is model_class
    with pytest.raises(TypeError, match="SRULanguageModel takes a SRUConfig, got SRUppConfig"):
        SRULanguageModel(SRUppConfig())


@pytest.mark.parametrize("kind,key,owners", [("srupp", "ffn_mult", "transformer"),
                                             ("transformer", "proj_size", "srupp"),
                                             ("lstm", "num_heads", "srupp or transformer"),
                                             ("gru", "highway_bias", "srupp or sru")])
def test_a_field_of_another_model_type_is_an_error(kind, key, owners):
    with pytest.raises(ValueError, match=f"^{key} applies to type={owners}, not {kind}$"):
        config_from_dict({"type": kind, key: 1})


def test_from_pretrained_gives_its_class_or_names_the_saved_type(tmp_path):
    torch.manual_seed(0)
    build_model({"type": "transformer", "num_heads": 2}).save_pretrained(tmp_path)
    assert type(CausalLM.from_pretrained(tmp_path)) is TransformerLanguageModel
    assert type(TransformerLanguageModel.from_pretrained(tmp_path)) is TransformerLanguageModel
    for cls in (SRULanguageModel, LanguageModel):
        with pytest.raises(ValueError, match=f"holds a transformer model, which {cls.__name__} "
                                             f"cannot load"):
            cls.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind", list(OLD))
def test_configs_saved_before_per_type_configs_still_load(tmp_path, kind):
    assert config_from_dict(json.loads(OLD[kind])) == EXPECTED[kind]
    # a whole old save: that config.json, and weights without a save id
    torch.manual_seed(0)
    m = build_model(EXPECTED[kind]).eval()
    save_model(m, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(OLD[kind])
    back = load_model(tmp_path)
    t = torch.randint(0, 11, (2, 5))
    assert type(back) is type(m) and torch.equal(back(t).logits, m(t).logits)


def boom(*args, **kwargs):
    raise OSError("disk full")


@pytest.mark.parametrize("before", ["saved", "saved before save ids"])
@pytest.mark.parametrize("fail,outcome", [("save_model", "old"), ("atomic_write_json", "mixed"),
                                          (None, "new")])
def test_an_interrupted_save_never_loads_a_mix(tmp_path, monkeypatch, before, fail, outcome):
    """A save that stops in its first file, between the two, or not at all: old, error, new."""
    torch.manual_seed(0)
    # the same shapes: without save ids, new weights under the old config would load
    old, new = build_model({"d_model": 8, "mem_len": 2}), build_model({"d_model": 8})
    t = torch.randint(0, 256, (1, 4))
    expect = {"old": old.eval()(t).logits, "new": new.eval()(t).logits}
    old.save_pretrained(tmp_path)
    if before == "saved before save ids":
        save_model(old, str(tmp_path / "model.safetensors"))
        flat = {**json.loads(OLD["srupp"]), **old.config.to_dict()}
        (tmp_path / "config.json").write_text(json.dumps(flat))
    if fail:
        monkeypatch.setattr(base, fail, boom)
        with pytest.raises(OSError, match="disk full"):
            new.save_pretrained(tmp_path)
        monkeypatch.undo()
    else:
        new.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    if outcome == "mixed":
        with pytest.raises(UserError, match="config.json and model.safetensors come from "
                                            "different saves"):
            load_model(tmp_path)
    else:
        assert torch.equal(load_model(tmp_path)(t).logits, expect[outcome])


@pytest.mark.parametrize("kind", list(MODELS))
def test_parameter_counts_split_the_total(kind):
    cfg = {"type": kind, "d_model": 16, "tie_embeddings": True,
           **({"num_heads": 2} if kind == "transformer" else {})}
    counts = parameter_counts(cfg)
    m = build_model(cfg)
    assert counts["params"] == m.num_parameters() == sum(
        counts[k] for k in ("embedding", "layers", "output"))
    assert counts["embedding"] == 256 * 16 and counts["output"] == 256  # tied: the bias alone


def test_model_modules_import_each_other_without_a_cycle():
    """Imports inside functions count: the graph of srupp.models modules is acyclic."""
    pkg = Path(base.__file__).parent
    graph = {}
    for f in pkg.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
        graph[f.stem] = deps & {p.stem for p in pkg.glob("*.py")}
    done, path = set(), []

    def visit(n):
        assert n not in path, f"import cycle: {' -> '.join(path + [n])}"
        if n not in done:
            path.append(n)
            for m in graph[n]:
                visit(m)
            path.pop()
            done.add(n)

    for n in graph:
        visit(n)
