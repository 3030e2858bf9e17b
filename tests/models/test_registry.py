"""One registry of model types: configs per type, saving and loading, counts."""

import ast
import json
from pathlib import Path

import pytest
import torch

import srupp.models.base as base
from srupp.errors import UserError
from srupp.models import (CausalLM, EncoderDecoder, SequenceClassifier, build_model,
                          config_from_dict, load_model, parameter_counts)
from srupp.models.config import (GRUConfig, LSTMConfig, SRUConfig, SRUppClassifierConfig,
                                 SRUppConfig, TransformerConfig)
from srupp.models.registry import REGISTRY

MODELS = REGISTRY["lm"]
CONFIGS = {"srupp": SRUppConfig, "sru": SRUConfig, "lstm": LSTMConfig, "gru": GRUConfig,
           "transformer": TransformerConfig}


def test_one_registry_of_configs_and_models():
    assert list(MODELS) == ["srupp", "sru", "lstm", "gru", "transformer"]
    for kind, (config_class, model_class) in MODELS.items():
        assert config_class.type == kind and config_class.task == "lm"
        assert config_class is CONFIGS[kind] and model_class is CausalLM
        m = build_model({"type": kind})
        assert type(m) is CausalLM and type(m.config) is config_class
    with pytest.raises(TypeError, match="CausalLM takes a lm model config, got "
                                        "SRUppClassifierConfig"):
        CausalLM(SRUppClassifierConfig(vocab_size=5, num_labels=2))


@pytest.mark.parametrize("kind,key,owners", [("srupp", "ffn_mult", "transformer"),
                                             ("transformer", "proj_size", "srupp"),
                                             ("lstm", "num_heads", "srupp or transformer"),
                                             ("gru", "highway_bias", "srupp or sru")])
def test_a_field_of_another_model_type_is_an_error(kind, key, owners):
    with pytest.raises(ValueError, match=f"^{key} applies to type={owners}, not {kind}$"):
        config_from_dict({"type": kind, key: 1})


def test_from_pretrained_gives_its_class_or_names_the_saved_task(tmp_path):
    torch.manual_seed(0)
    build_model({"type": "transformer", "num_heads": 2}).save_pretrained(tmp_path)
    back = CausalLM.from_pretrained(tmp_path)
    assert type(back) is CausalLM and back.config.type == "transformer"
    for cls in (EncoderDecoder, SequenceClassifier):
        with pytest.raises(ValueError, match=f"holds a lm model, which {cls.__name__} "
                                             f"cannot load"):
            cls.from_pretrained(tmp_path)


@pytest.mark.parametrize("version", [None, 0, 2, "1", True])
def test_a_config_of_another_format_version_is_one_user_error(tmp_path, version):
    build_model({"d_model": 8}).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["format_version"] == 1 and saved["task"] == "lm"
    saved.pop("format_version")
    if version is not None:
        saved["format_version"] = version
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match="format_version") as e:
        load_model(tmp_path)
    assert "\n" not in str(e.value)


def boom(*args, **kwargs):
    raise OSError("disk full")


@pytest.mark.parametrize("fail,outcome", [("save_weights", "old"), ("atomic_write_json", "mixed"),
                                          (None, "new")])
def test_an_interrupted_save_never_loads_a_mix(tmp_path, monkeypatch, fail, outcome):
    """A save that stops in its first file, between the two, or not at all: old, error, new."""
    torch.manual_seed(0)
    # the same shapes: without save ids, new weights under the old config would load
    old, new = build_model({"d_model": 8, "mem_len": 2}), build_model({"d_model": 8})
    t = torch.randint(0, 256, (1, 4))
    expect = {"old": old.eval()(t).logits, "new": new.eval()(t).logits}
    old.save_pretrained(tmp_path)
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
    name = lambda f: ".".join(f.relative_to(pkg).with_suffix("").parts)  # noqa: E731
    files = {name(f): f for f in pkg.rglob("*.py")}
    graph = {}
    for mod, f in files.items():
        here = mod.split(".")[:-1]  # the package the module is in
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                at = here[:len(here) - node.level + 1]
                targets = [node.module] if node.module else [a.name for a in node.names]
                deps |= {".".join(at + t.split(".")) for t in targets}
        graph[mod] = {d if d in files else d + ".__init__" for d in deps} & set(files)
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


class _FlatViews(torch.nn.Module):
    """Weights kept as views into one flat buffer, as cuDNN keeps an LSTM's on CUDA,
    plus a pair of tied weights."""

    def __init__(self):
        super().__init__()
        self.flat = torch.zeros(14)
        self.a = torch.nn.Parameter(self.flat[:6].view(2, 3))
        self.b = torch.nn.Parameter(self.flat[6:])
        self.emb = torch.nn.Linear(3, 2, bias=False)
        self.out = torch.nn.Linear(3, 2, bias=False)
        self.out.weight = self.emb.weight


def test_weights_that_view_a_flat_buffer_and_tied_weights_save_and_load(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_model

    src = _FlatViews()
    with torch.no_grad():
        for p in src.parameters():
            p.copy_(torch.randn(p.shape))
    with pytest.raises(RuntimeError, match="None is covering"):  # why save_weights exists
        save_model(src, str(tmp_path / "refused.safetensors"))
    base.save_weights(src, tmp_path / "w.safetensors", metadata={"save_id": "x"})
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["a", "b", "emb.weight"]  # the tie is written once
        assert f.metadata() == {"save_id": "x", "out.weight": "emb.weight"}

    dst = _FlatViews()
    base.load_weights(dst, tmp_path / "w.safetensors")
    for (name, p), q in zip(dst.named_parameters(), src.parameters()):
        assert torch.equal(p, q), name
    assert dst.out.weight is dst.emb.weight
    assert dst.a.data_ptr() == dst.flat.data_ptr()  # loaded into the buffer, still one
    assert torch.equal(dst.flat, torch.cat([src.a.flatten(), src.b]))


def test_weights_saved_by_safetensors_save_model_load_alike(tmp_path):
    from safetensors.torch import save_model

    src = build_model(dict(type="srupp", vocab_size=11, d_model=8, num_layers=1,
                           tie_embeddings=True))
    save_model(src, str(tmp_path / "old.safetensors"))
    dst = build_model(dict(type="srupp", vocab_size=11, d_model=8, num_layers=1,
                           tie_embeddings=True))
    base.load_weights(dst, tmp_path / "old.safetensors")
    for (name, p), q in zip(dst.state_dict().items(), src.state_dict().values()):
        assert torch.equal(p, q), name


def test_weights_of_another_model_are_refused_by_name(tmp_path):
    base.save_weights(_FlatViews(), tmp_path / "w.safetensors")
    with pytest.raises(RuntimeError, match=r"missing \[.*unexpected \['a', 'b'"):
        base.load_weights(torch.nn.Linear(3, 2), tmp_path / "w.safetensors")
