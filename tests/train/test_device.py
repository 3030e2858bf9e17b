"""The trainer's device paths, their logic checked on the CPU.

Batches reach CUDA from pinned memory without blocking (the CPU path is a
plain ``to``); a training step reads nothing back from the device; on CUDA
only the steps whose time or loss is read wait for it; fp16's GradScaler
survives a resume; and a short run on ``--device`` (fp32, bf16, fp16 on CUDA)
resumes as if never stopped.
"""

import sys
from pathlib import Path

import pytest
import torch

from srupp.train import device as device_mod
from srupp.train.device import synchronize
from srupp.inference import pad_batch, to_device


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


# ------------------------------------------------------------------ no waiting inside a step

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def _count_reads(monkeypatch, trainer):
    """Count reads of tensor values made by srupp's code, by the step they belong to.

    Reads by torch itself (the optimiser's CPU step counters) are not counted: they
    stay on the host on CUDA too. A read after step k's forward and backward (its
    logging) belongs to step k.
    """
    import srupp

    root = str(Path(srupp.__file__).parent)
    reads, current = [], [0]

    def counted(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(root):
                reads.append((current[0], name))
            return real(self, *args, **kwargs)
        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    real_step = type(trainer)._train_step

    def step(self, it):
        current[0] = self.step + 1
        return real_step(self, it)

    monkeypatch.setattr(type(trainer), "_train_step", step)
    return reads


@pytest.mark.parametrize("task", ["lm", "translate"])
def test_a_training_step_reads_nothing_back_from_the_device(tmp_path, corpus, monkeypatch,
                                                            task):
    """Only logging (every 4th step here) reads the loss; the other steps queue work only."""
    from srupp.train import Trainer, build_config

    from lm_helpers import config

    every = ["train.max_steps=8", "train.log_every=4", "train.eval_every=100",
             "train.save_every=100"]
    if task == "lm":
        cfg = config(corpus, *every)
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from test_tasks import TRANSLATE, pairs as make_pairs

        cfg = build_config(None, [*TRANSLATE, f"data.corpus={make_pairs.__wrapped__(tmp_path)}",
                                  "train.grad_accum=2", *every])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    reads = _count_reads(monkeypatch, trainer)
    trainer.train()
    per_step = {s: sum(1 for r, _ in reads if r == s) for s in range(1, 9)}
    assert {s for s, n in per_step.items() if n} == {4, 8}, reads   # the logging steps


def test_cuda_steps_wait_for_the_device_only_where_their_time_or_loss_is_read(
        tmp_path, corpus, monkeypatch):
    """The trainer's waiting rule, run on the CPU as if the host ran ahead of a GPU."""
    from srupp.train import Trainer
    from srupp.train import trainer as trainer_mod
    from srupp.train.schedule import CALIBRATION_SKIP, StepSchedule

    from lm_helpers import config

    t = Trainer(config(corpus, "train.max_steps=100000", "train.max_seconds=1.5",
                       "train.calibration_steps=4", "train.log_every=8",
                       "train.eval_every=100000", "train.save_every=100000"),
                tmp_path / "run", progress=False)
    monkeypatch.setattr(Trainer, "_runs_ahead", True)
    waited, refits = [], []
    monkeypatch.setattr(trainer_mod, "synchronize", lambda device: waited.append(t.step))
    real_refit = StepSchedule.refit
    monkeypatch.setattr(StepSchedule, "refit", lambda self, step, seconds: (
        refits.append(step), real_refit(self, step, seconds)))
    t.train()
    calibration = set(range(1, CALIBRATION_SKIP + 4 + 1))   # each step's own time
    logs = set(range(8, t.step + 1, 8))
    assert refits and set(refits) <= set(waited)             # a re-fit sees the time up to it
    assert set(waited) == calibration | logs | set(refits) | {t.step}


def _stop_after(trainer, step, monkeypatch):
    """Make ``trainer`` stop and save after ``step``, as a signal then would."""
    real_step = type(trainer)._train_step

    def step_then_stop(self, it):
        out = real_step(self, it)
        if self.step == step:
            self._stop.count = 1  # as SIGINT would
        return out

    monkeypatch.setattr(trainer, "_train_step", step_then_stop.__get__(trainer))


def _untimed(run, keys=("step", "train_loss", "lr", "valid_loss")):
    from lm_helpers import metrics

    return [{k: r[k] for k in keys if k in r} for r in metrics(run)]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_on_the_device_resumes_as_if_never_stopped(tmp_path, corpus, device,
                                                            precision, monkeypatch):
    """train.device and precision end to end: 6 steps straight, or 3, a save, and 3 more."""
    from srupp.train import Trainer
    from srupp.runs import resolve_checkpoint
    from srupp.train.checkpoint import load_trainer_state

    from lm_helpers import config

    if precision == "fp16" and device.type != "cuda":
        pytest.skip("fp16 (with its GradScaler) trains on CUDA only")
    cfg = config(corpus, f"train.device={device.type}", f"train.precision={precision}",
                 "train.max_steps=6", "train.save_every=6", "train.eval_every=6",
                 "model.dropout=0")
    straight = Trainer(cfg, tmp_path / "straight", progress=False)
    straight.train()
    assert next(straight.model.parameters()).device.type == device.type

    run = tmp_path / "resumed"
    first = Trainer(cfg, run, progress=False)
    _stop_after(first, 3, monkeypatch)
    assert first.train()["interrupted"]
    saved = load_trainer_state(resolve_checkpoint(run, prefer="last"))
    assert (saved["scaler"] is not None) == (precision == "fp16")
    resumed = Trainer(cfg, run, resume=True, progress=False)
    if precision == "fp16":
        assert resumed.scaler.state_dict() == saved["scaler"]
    resumed.train()
    rows = [_untimed(r) for r in (run, tmp_path / "straight")]
    # CUDA's attention backward may add in another order from run to run
    exact = device.type == "cpu"
    assert rows[0] == (rows[1] if exact else [pytest.approx(r, rel=1e-3) for r in rows[1]])


def test_fp16s_grad_scaler_is_saved_and_restored_exactly(tmp_path, corpus, monkeypatch):
    """The loss scale and growth count continue across a resume as in a run never stopped.

    fp16 trains on CUDA only; its scaler is the same object on the CPU, enabled here
    over fp32 steps (scaling by a power of two changes no gradient), doubling its
    scale every step that has no inf, so that a scale not restored would show.
    """
    from srupp.train import Trainer
    from srupp.runs import resolve_checkpoint
    from srupp.train.checkpoint import load_trainer_state

    from lm_helpers import config

    real = torch.amp.GradScaler
    monkeypatch.setattr(torch.amp, "GradScaler",
                        lambda device, enabled: real("cpu", init_scale=2.0 ** 10,
                                                     growth_interval=1))
    cfg = config(corpus, "train.max_steps=8", "model.dropout=0")
    straight = Trainer(cfg, tmp_path / "straight", progress=False)
    straight.train()
    assert straight.scaler.get_scale() == 2.0 ** 18

    run = tmp_path / "resumed"
    first = Trainer(cfg, run, progress=False)
    _stop_after(first, 3, monkeypatch)
    assert first.train()["interrupted"]
    saved = load_trainer_state(resolve_checkpoint(run, prefer="last"))["scaler"]
    assert saved == {"scale": 2.0 ** 13, "growth_factor": 2.0, "backoff_factor": 0.5,
                     "growth_interval": 1, "_growth_tracker": 0}
    resumed = Trainer(cfg, run, resume=True, progress=False)
    assert resumed.scaler.state_dict() == saved
    resumed.train()
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    assert _untimed(run) == _untimed(tmp_path / "straight")
