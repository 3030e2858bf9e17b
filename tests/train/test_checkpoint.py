"""A checkpoint's carried state: a state file (srupp.models.save_state)."""

import pytest
import torch

from srupp.errors import UserError
from srupp.models import TensorState, build_model, load_state
from srupp.nn import SRUppState
from srupp.train.checkpoint import load_carried_state, save_checkpoint


def model_and_state(kind):
    """A tiny language model of ``kind`` and the state it carries after a segment."""
    torch.manual_seed(0)
    own = {"srupp": dict(proj_size=4)}.get(kind, {})
    m = build_model(dict(vocab_size=11, d_model=8, num_layers=2, dropout=0.0, mem_len=4,
                         type=kind, **own)).eval()
    with torch.no_grad():
        return m, m(torch.randint(0, 11, (2, 5))).state


def assert_same_tensors(back, state):
    want, got = state.to_dict(), back.to_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("kind, cls", [("srupp", SRUppState), ("lstm", TensorState)])
def test_the_carried_state_is_a_state_file(tmp_path, kind, cls):
    m, state = model_and_state(kind)
    ckpt = save_checkpoint(tmp_path / "run", 3, m, state, {"step": 3})
    for back in (load_carried_state(ckpt), load_state(ckpt / "state.safetensors")):
        assert type(back) is cls
        assert_same_tensors(back, state)


def test_a_damaged_carried_state_is_a_user_error(tmp_path):
    assert load_carried_state(tmp_path) is None  # a task that carries no state
    m, state = model_and_state("srupp")
    ckpt = save_checkpoint(tmp_path / "run", 3, m, state, {"step": 3})
    f = ckpt / "state.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_carried_state(ckpt)
