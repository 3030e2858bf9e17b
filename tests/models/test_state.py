"""State files: save_state / load_state keep a decoding state, and another process resumes it."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from srupp.models import (TensorState, build_model, load_state, load_state_metadata,
                          save_state)
from srupp.models.state import CLASS_KEY
from srupp.nn import SRUppState

KINDS = ["srupp", "sru", "lstm", "gru", "transformer"]
OWN = {"srupp": dict(proj_size=4), "transformer": dict(num_heads=2)}  # fields of one type
TOL = dict(rtol=1e-5, atol=1e-6)  # K/V recomputed from memory after loading: last bits may move


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes (tests/conftest.py)


def make(kind, device=None):
    """A tiny language model of ``kind`` whose memory keeps 4 positions, built on the CPU
    (the same weights whatever the device) and moved to ``device``."""
    torch.manual_seed(0)
    m = build_model(dict(vocab_size=11, d_model=8, num_layers=2, dropout=0.0, mem_len=4,
                         type=kind, **OWN.get(kind, {}))).eval()
    if kind == "srupp":
        with torch.no_grad():  # give attention a say (α starts at 0)
            for layer in m.backbone.rnn.layers:
                layer.transform.alpha.fill_(0.7)
    return m.to(device)


def held(state):
    """The tensors a state holds (to_dict adds bookkeeping it makes on the CPU: mem_len,
    batch dimensions)."""
    if isinstance(state, TensorState):
        return dict(state.tensors)
    parts = {"c": state.c, "memory_mask_pad": state.memory_mask_pad,
             **{f"memory.{i}": m for i, m in enumerate(state.memory)}}
    return {k: t for k, t in parts.items() if t is not None}


def assert_same_state(back, state, device=torch.device("cpu")):
    """Same class, same tensors (names, values, dtypes), held on ``device`` (by default the
    CPU, where load_state puts them unless told otherwise)."""
    assert type(back) is type(state)
    want, got = state.to_dict(), back.to_dict()
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].cpu(), t.cpu()), k
    assert held(back).keys() == held(state).keys()
    for k, t in held(back).items():
        assert t.device.type == device.type, k
    if isinstance(state, TensorState):
        assert back.batch_dims == state.batch_dims


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_of_every_model_s_state(tmp_path, kind, device):
    m = make(kind, device)
    tokens = torch.tensor([[3, 1, 4, 1, 5], [0, 0, 2, 6, 5]], device=device)
    pad = torch.tensor([[False] * 5, [True, True, False, False, False]], device=device)
    with torch.no_grad():  # padding inside the window: SRU++ and transformer keep a mask
        state = m(tokens, m.generation_state(2, mem_len=4), mask_pad=pad).state
    save_state(state, tmp_path / "s.safetensors")
    assert_same_state(load_state(tmp_path / "s.safetensors"), state)       # onto the CPU
    back = load_state(tmp_path / "s.safetensors", device=device)         # onto the model's
    assert_same_state(back, state, device)
    if kind == "srupp":
        assert back.mem_len == 4 and back.memory_mask_pad is not None
        assert all(kv is None for kv in back.kv_cache)  # derived data: not saved
    t = torch.randint(0, 11, (2, 3)).to(device)
    torch.testing.assert_close(m(t, back).logits, m(t, state).logits, **TOL)


def test_round_trip_keeps_dtypes_and_optional_parts(tmp_path, device):
    g = torch.Generator().manual_seed(0)  # made on the CPU, saved from the device
    sru_pp = SRUppState(c=torch.randn(2, 3, 4, generator=g).to(device),
                        memory=[torch.randn(3, 5, 6, generator=g).to(device, torch.bfloat16),
                                None],
                        memory_mask_pad=(torch.rand(3, 5, generator=g) > 0.5).to(device),
                        mem_len=7)
    tensors = TensorState({"x": torch.randn(4, 3, dtype=torch.float64, generator=g),
                           "half": torch.randn(3, 2, generator=g).half(),
                           "flag": torch.zeros(3).bool(), "n": torch.tensor(-1)},
                          {"x": 1, "half": 0, "flag": 0, "n": None}).to(device)
    for state in (sru_pp, tensors):
        save_state(state, tmp_path / "s.safetensors")
        assert_same_state(load_state(tmp_path / "s.safetensors"), state)
        assert_same_state(load_state(tmp_path / "s.safetensors", device=device), state, device)
    back = load_state(tmp_path / "s.safetensors", device="meta")  # device= moves the tensors
    assert back["x"].device.type == "meta" and back.batch_dims["n"] is None


def test_a_state_saves_and_loads_onto_a_device(tmp_path, device):
    state = SRUppState(c=torch.randn(2, 1, 4, device=device),
                       memory=[torch.randn(1, 3, 4, device=device), None])
    save_state(state, tmp_path / "s.safetensors")
    back = load_state(tmp_path / "s.safetensors", device=device)
    assert back.c.device == state.c.device and torch.equal(back.c, state.c)
    assert torch.equal(back.memory[0], state.memory[0])


def test_metadata_and_replacing_a_file(tmp_path):
    m = make("srupp")
    path = tmp_path / "conversation.safetensors"
    save_state(m.initial_state(1), path, metadata={"conversation": "42"})
    with torch.no_grad():
        state = m(torch.tensor([[1, 2, 3]])).state
    save_state(state, path, metadata={"conversation": "42", "turn": "2"})
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    assert load_state_metadata(path) == {"conversation": "42", "turn": "2"}
    assert load_state(path).memory_length == 3


def test_loaded_tensors_are_aligned_like_fresh_ones(tmp_path):
    """A file packs its tensors at any byte offset; loading gives each its own aligned
    memory, so kernels sum in the order they did before saving (bit-exact resume)."""
    # 12-byte tensors: whatever the header's size, some land off a 64-byte boundary
    state = TensorState({f"t{i}": torch.randn(3, 1) for i in range(8)}, {})
    path = tmp_path / "state.safetensors"
    save_state(state, path)
    loaded = load_state(path)
    assert all(torch.equal(loaded[k], state[k]) for k in state.tensors)
    assert [k for k in state.tensors if loaded[k].data_ptr() % 64] == []


# ------------------------------------------------- resuming in a fresh process
# Loads the model and the state from their files only, onto the device the parent decodes
# on, then decodes greedily. On CUDA it computes fp32 in IEEE fp32, as the parent does under
# tests/conftest.py (cuDNN's LSTM would otherwise take TF32).
CHILD = r"""
import json, sys
import torch
from srupp.models import load_model, load_state

torch.set_num_threads(1)
model_dir, state_file, token, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
device = torch.device(sys.argv[5])
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
model = load_model(model_dir, device=device)
state = load_state(state_file, device=device)
tokens, logits = [], []
with torch.no_grad():
    for _ in range(steps):
        out, state = model.step(torch.tensor([token], device=device), state)
        token = int(out[0].argmax())
        tokens.append(token)
        logits.append(out[0].tolist())
print(json.dumps({"tokens": tokens, "logits": logits}))
"""


def greedy(m, token, state, steps):
    """``steps`` greedy tokens after ``token`` -> (tokens, logits (steps, V), final state)."""
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            out, state = m.step(torch.tensor([token], device=m.device), state)
            token = int(out[0].argmax())
            tokens.append(token)
            logits.append(out[0])
    return tokens, torch.stack(logits), state


@pytest.mark.parametrize("kind", ["srupp", "lstm", "transformer"])
def test_a_state_saved_mid_decoding_resumes_in_a_fresh_process(tmp_path, kind, device):
    m = make(kind, device)
    N, M = 5, 6  # N + M steps: the 4-position memory window moves while decoding
    with torch.no_grad():
        prompt = m(torch.tensor([[1, 5, 2, 7]], device=device), m.generation_state(1, mem_len=4))
    first = int(prompt.logits[0, -1].argmax())
    tokens, logits, _ = greedy(m, first, prompt.state, N + M)  # one uninterrupted decode
    head, _, state = greedy(m, first, prompt.state, N)          # the same N steps, then park
    assert head == tokens[:N]
    save_state(state, tmp_path / "conversation.safetensors")
    m.save_pretrained(tmp_path / "model")

    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "model"),
                          str(tmp_path / "conversation.safetensors"), str(head[-1]), str(M),
                          str(device)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    child = json.loads(run.stdout.strip().splitlines()[-1])
    assert child["tokens"] == tokens[N:]
    torch.testing.assert_close(torch.tensor(child["logits"], device=device), logits[N:], **TOL)
    # the check has teeth: without the saved state the continuation differs
    _, fresh, _ = greedy(m, head[-1], m.generation_state(1, mem_len=4), M)
    assert not torch.allclose(fresh, logits[N:], atol=1e-3)


# ------------------------------------------------------------------ bad input
def test_missing_wrong_and_damaged_files_are_value_errors(tmp_path):
    good = tmp_path / "good.safetensors"
    save_state(make("lstm").initial_state(1), good)
    blob = good.read_bytes()
    c = {"c": torch.zeros(2, 1, 4)}
    files = {name: tmp_path / f"{name}.safetensors" for name in
             ("plain", "unknown", "damaged", "half", "short", "last_byte_cut")}
    save_file(c, str(files["plain"]))  # a safetensors file, but no state file
    save_file(c, str(files["unknown"]), metadata={CLASS_KEY: "GRUState"})
    save_file(c, str(files["damaged"]), metadata={CLASS_KEY: "TensorState"})  # no marker
    files["half"].write_bytes(blob[:len(blob) // 2])
    files["short"].write_bytes(blob[:4])
    files["last_byte_cut"].write_bytes(blob[:-1])
    (tmp_path / "notes.txt").write_text("not a state at all")
    make("srupp").save_pretrained(tmp_path / "model")

    cases = [(tmp_path / "nowhere.safetensors", "does not exist"),
             (tmp_path, "is a folder"),
             (files["plain"], "not a saved state"),
             (tmp_path / "model" / "model.safetensors", "not a saved state"),
             (files["unknown"], "class 'GRUState'"),
             (files["damaged"], "damaged TensorState"),
             (files["half"], "truncated or corrupt"),
             (files["short"], "truncated or corrupt"),
             (files["last_byte_cut"], "truncated or corrupt"),
             (tmp_path / "notes.txt", "truncated or corrupt")]
    for path, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            load_state(path)
        assert type(e.value) is ValueError, path
    with pytest.raises(ValueError, match="not a saved state"):
        load_state_metadata(files["plain"])


def test_save_refuses_what_it_cannot_keep(tmp_path):
    state = make("gru").initial_state(1)
    path = tmp_path / "s.safetensors"
    with pytest.raises(TypeError, match="SRUppState or a TensorState"):
        save_state({"h": torch.zeros(1)}, path)
    with pytest.raises(TypeError, match="str to str"):
        save_state(state, path, metadata={"turn": 3})
    with pytest.raises(ValueError, match="srupp's own"):
        save_state(state, path, metadata={CLASS_KEY: "SRUppState"})
    with pytest.raises(ValueError, match="does not exist"):
        save_state(state, tmp_path / "no" / "s.safetensors")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ joining states
@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_tensor_states_join_rows_as_index_select_splits_them(kind, device):
    m = make(kind, device)
    tokens = torch.tensor([[3, 1, 4, 1, 5], [0, 0, 2, 6, 5], [0, 0, 0, 9, 2]], device=device)
    pad = (torch.arange(5) < torch.tensor([[0], [2], [3]])).to(device)
    with torch.no_grad():
        state = m(tokens, m.generation_state(3, mem_len=4), mask_pad=pad).state
    order = [2, 0, 1]
    joined = TensorState.cat([state.index_select([2]), state.index_select([0, 1])])
    want = state.index_select(order)
    assert joined.batch_dims == want.batch_dims and joined.tensors.keys() == want.tensors.keys()
    for k, t in want.tensors.items():
        assert torch.equal(joined[k], t), k
    if kind == "transformer":  # the window is shared, not batched: one copy
        assert joined.batch_dims["window"] is None and int(joined["window"]) == 4
    assert TensorState.cat([state]).tensors.keys() == state.tensors.keys()
    # keep_rows, the engine's compaction: index_select's rows; bad rows a ValueError
    kept = state.keep_rows([0, 2])
    for k, t in state.index_select([0, 2]).tensors.items():
        assert torch.equal(kept[k], t), k
    with pytest.raises(ValueError, match="keep_rows: rows must be ascending"):
        state.keep_rows([2, 0])
    nxt = torch.tensor([[7], [8], [9]], device=device)
    with torch.no_grad():
        torch.testing.assert_close(m(nxt, joined).logits, m(nxt, want).logits, **TOL)


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_tensor_state_put_row_writes_one_row_in_place(kind, device):
    m = make(kind, device)
    tokens = torch.tensor([[3, 1, 4, 1, 5], [0, 0, 2, 6, 5], [0, 0, 0, 9, 2]], device=device)
    with torch.no_grad():
        batch = m(tokens, m.backbone.padded_state(3, 6)).state
        new = m(tokens[:1, :2], m.backbone.padded_state(1, 6)).state
    others = batch.index_select([0, 2])
    batch.put_row(1, new)
    for k, t in new.tensors.items():
        d = batch.batch_dims[k]
        row = batch[k] if d is None else batch[k].narrow(d, 1, 1)
        assert torch.equal(row, t), k
        if d is not None:
            assert torch.equal(batch[k].index_select(d, torch.tensor([0, 2], device=device)),
                               others[k]), k
    with pytest.raises(ValueError, match="different tensors|not one row"):
        batch.put_row(0, batch)


def test_tensor_state_cat_refuses_states_made_differently():
    a = TensorState({"h": torch.zeros(2, 1, 3), "pad": torch.ones(1, 4, dtype=torch.bool),
                     "n": torch.tensor(4)}, {"h": 1, "pad": 0, "n": None})
    no_pad = TensorState({"h": torch.zeros(2, 1, 3), "n": torch.tensor(4)}, {"h": 1, "n": None})
    other_n = TensorState(dict(a.tensors, n=torch.tensor(5)), dict(a.batch_dims))
    joined = TensorState.cat([a, a])
    assert joined["h"].shape == (2, 2, 3) and joined["pad"].shape == (2, 4)
    with pytest.raises(ValueError, match="different tensors"):
        TensorState.cat([a, no_pad])
    with pytest.raises(ValueError, match="shared tensor 'n' differs"):
        TensorState.cat([a, other_n])
    with pytest.raises(ValueError, match="at least one"):
        TensorState.cat([])
