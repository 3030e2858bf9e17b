"""srupp.train.device: batches reach CUDA from pinned memory without blocking; the CPU is untouched."""

import pytest
import torch

from srupp.train import device as device_mod
from srupp.train.device import synchronize, to_device
from srupp.train.tasks import pad_batch


@pytest.fixture
def transfers(monkeypatch):
    """Record pin_memory() and to() calls instead of making them (no GPU needed)."""
    calls = []

    def pin_memory(self):
        calls.append(("pin",))
        return self

    def to(self, *args, **kwargs):
        calls.append(("to", torch.device(args[0]), kwargs.get("non_blocking", False)))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    return calls


def test_cuda_target_pins_then_copies_without_blocking(transfers):
    t = torch.arange(6).view(2, 3)
    assert to_device(t, "cuda") is t
    assert transfers == [("pin",), ("to", torch.device("cuda"), True)]
    transfers.clear()
    to_device(t, torch.device("cuda", 1))
    assert transfers == [("pin",), ("to", torch.device("cuda", 1), True)]


def test_cpu_target_is_a_plain_copy_without_pinning(transfers):
    t = torch.arange(6)
    to_device(t, "cpu")
    to_device(t, torch.device("cpu"))
    assert transfers == [("to", torch.device("cpu"), False)] * 2


def test_padded_batches_go_through_the_helper(transfers):
    pad_batch([[1, 2, 3], [4]], "cuda")
    assert transfers == [("pin",), ("to", torch.device("cuda"), True)] * 2


def test_to_device_is_exact_and_leaves_cpu_tensors_alone(device):
    t = torch.arange(12).view(3, 4)
    out = to_device(t, device)
    assert out.device.type == device.type
    torch.testing.assert_close(out.cpu(), t, rtol=0, atol=0)
    if device.type == "cpu":
        assert out is t                       # no copy, no pinning
    ids, pad = pad_batch([[5, 6, 7], [8]], device)
    assert ids.device.type == pad.device.type == device.type
    assert ids.cpu().tolist() == [[5, 6, 7], [8, 0, 0]]
    assert pad.cpu().tolist() == [[False, False, False], [False, True, True]]


def test_synchronize_waits_only_for_cuda(monkeypatch):
    waited = []
    monkeypatch.setattr(device_mod.torch.cuda, "synchronize", lambda d=None: waited.append(d))
    synchronize("cpu")
    assert waited == []
    synchronize("cuda")
    assert waited == [torch.device("cuda")]
