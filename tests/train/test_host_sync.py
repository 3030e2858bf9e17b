"""A training step never makes the host wait for the device.

On CUDA the host only queues work, and runs ahead of the GPU while the step's
kernels run. Reading a value back (``.item()``, ``bool(t)``), or an op whose
output size depends on the data (``nonzero``, a boolean index), makes the host
wait for everything queued before it: the GPU then runs dry while the host
launches what follows. The trainer reads values back only at its logging,
evaluation, saving and progress-bar intervals (:mod:`srupp.train.device`).

The check records, under a ``TorchDispatchMode``, the ATen ops that synchronise
on CUDA, during training steps away from those intervals. On the CPU nothing
waits, but the same ops run in the code that every device shares; ``pytest
--device cuda`` runs it on the GPU, where CUDA's own sync debug mode also
reports every synchronising call, the Triton recurrence's among them.
"""

import collections
import traceback
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from srupp.train import Trainer

from lm_helpers import baseline_config, config

# The ATen ops that wait for a CUDA device, and why:
SYNCING = {
    # item(), float(t), int(t), bool(t), `if t:`: the value is copied to the host
    "aten._local_scalar_dense",
    # bool() of a tensor, where it is dispatched whole
    "aten.is_nonzero",
    # return a Python bool
    "aten.equal", "aten.allclose",
    # the output's length is the data's: the host reads it to allocate the output
    "aten.nonzero", "aten.argwhere", "aten.masked_select",
    "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
    "aten.unique_dim_consecutive",
    # length = largest value + 1, read back (also with minlength)
    "aten.bincount",
}
# ops that wait only with some arguments (checked in _waits)
SOMETIMES = {
    "aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_",  # a bool mask
    "aten.repeat_interleave",  # repeats as a tensor, without output_size
    "aten._to_copy", "aten.copy_",  # from a CUDA tensor to the host, blocking
}


def _is_bool_mask(indices) -> bool:
    return isinstance(indices, (list, tuple)) and any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices)


def _waits(func, args, kwargs) -> bool:
    name = f"aten.{func._opname}"
    if name in SYNCING:
        return True
    if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
        return _is_bool_mask(args[1])
    if name == "aten.repeat_interleave":
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name == "aten._to_copy":
        return (args[0].is_cuda and torch.device(kwargs.get("device") or "cuda").type == "cpu"
                and not kwargs.get("non_blocking", False))
    if name == "aten.copy_":
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return args[1].is_cuda and args[0].device.type == "cpu" and not non_blocking
    return False


class HostWaits(TorchDispatchMode):
    """Records the ops that run inside it and make the host wait: those of :data:`SYNCING`
    (and :data:`SOMETIMES`, where they wait), and on CUDA with ``cuda=True`` any op that
    CUDA's sync debug mode reports, as (op, first tensor argument, srupp's calling line)."""

    def __init__(self, cuda: bool = False):
        super().__init__()
        self.cuda = cuda
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"aten.{func._opname}"
        listed = (name in SYNCING or name in SOMETIMES) and _waits(func, args, kwargs)
        synced = False
        if self.cuda:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                out = func(*args, **kwargs)
            synced = any(_is_cuda_sync(w) for w in seen)
        else:
            out = func(*args, **kwargs)
        if listed or synced:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.calls.append((str(func) if listed else f"CUDA sync in {func}", first, _caller()))
        return out


def _is_cuda_sync(w) -> bool:
    """A warning of torch.cuda.set_sync_debug_mode("warn")."""
    return "synchronizing" in str(w.message).lower()


def _caller() -> str:
    """The innermost srupp line on the stack: where a recorded op comes from."""
    for frame in reversed(traceback.extract_stack()):
        if "/srupp/" in frame.filename and "/tests/" not in frame.filename:
            return f"{frame.filename.split('/srupp/')[-1]}:{frame.lineno} {frame.line}"
    return "?"


def _host_step_counters(optimizer):
    """The optimiser's step counts that live on the host.

    Unless fused or capturable, torch keeps each parameter's step count as a
    CPU tensor and reads it with ``.item()``, precisely so that reading it
    never waits for a device; on a CPU-only run the recorder cannot tell that
    from a device's value, so these are left out by identity.
    """
    return [s["step"] for s in optimizer.state.values()
            if isinstance(s.get("step"), torch.Tensor) and s["step"].device.type == "cpu"]


def _host_windows(state):
    """A transformer's carried window (the keys it keeps), which every forward reads as a
    number: it lives on the host whatever the model's device (checked here), so that
    reading it never waits; on a CPU-only run it is left out by identity."""
    window = getattr(state, "tensors", {}).get("window")
    if window is None:
        return []
    assert window.device.type == "cpu", "the transformer's window must stay on the host"
    return [window]


def _waits_in_steps(trainer, steps: int):
    """The host waits of ``steps`` training steps (after one that builds the optimiser's
    state), as the loop runs them between its intervals: {op: count}, and where."""
    it = trainer.batcher.iter_from(trainer.batcher.position)
    trainer.model.train()
    trainer._account(*trainer._train_step(it), 0.0)
    cuda = trainer.device.type == "cuda"
    with HostWaits(cuda) as rec, warnings.catch_warnings(record=True) as elsewhere:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                sums = trainer._train_step(it)
                assert not trainer._wait_for_device(0.0, refresh_bar=False)
                trainer._account(*sums, 0.0)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    counters, windows = _host_step_counters(trainer.optimizer), _host_windows(trainer.carried)
    # (each step's state detaches the window: a new tensor over the same memory)
    found = [(op, where) for op, t, where in rec.calls
             if not any(t is c for c in counters)
             and not any(t.data_ptr() == w.data_ptr() for w in windows)]
    # a wait outside any ATen op (a kernel launcher's own copy, a synchronize())
    found += [("CUDA sync outside an op", f"{w.filename}:{w.lineno}") for w in elsewhere
              if _is_cuda_sync(w)]
    return collections.Counter(op for op, _ in found), sorted(set(found))


# a language model with an adaptive input and softmax: the 256 bytes in three clusters
# (spaces and punctuation; capitals; most lower case), every batch has ids in each
ADAPTIVE = ("model.adaptive_cutoffs=60,100", "model.div_val=2", "model.emb_dim=16",
            "model.tie_embeddings=true")


# the transformer baseline, with memory: its state carries keys, values and the window
TRANSFORMER = ("model.mem_len=8",)


@pytest.mark.parametrize("output", ["softmax", "adaptive", "transformer"])
@pytest.mark.parametrize("optimizer", ["radam", "adamw"])
def test_training_steps_never_wait_for_the_device(tmp_path, corpus, device, output, optimizer):
    steps, accum = 2, 2
    extra = {"adaptive": ADAPTIVE, "transformer": TRANSFORMER}.get(output, ())
    # intervals past the steps run here: only the steps themselves are recorded
    make = ((lambda *a: baseline_config(corpus, "transformer", *a)) if output == "transformer"
            else (lambda *a: config(corpus, *a)))
    cfg = make(*extra, f"train.optimizer={optimizer}", f"train.grad_accum={accum}",
               f"train.device={device.type}", "train.max_steps=100", "train.log_every=50",
               "train.save_every=50", "train.eval_every=50")
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    try:
        counts, where = _waits_in_steps(trainer, steps)
    finally:
        trainer.close()
    expected = collections.Counter()
    if output == "adaptive":
        # Accepted: the adaptive softmax reads the row count of each tail cluster it
        # scores (srupp.nn.adaptive: scoring every row in every cluster instead costs
        # 7-16% more FLOPs per step and gigabytes of logits at the paper's batches).
        n_tail = len(trainer.model.output.cutoffs)
        expected["aten.nonzero.default"] = n_tail * accum * steps
    assert counts == expected, "\n".join(f"{op}: {w}" for op, w in where)


def test_the_recorder_sees_what_waits():
    """Each way of reading back that the trainer once had is recorded; nothing else is."""
    x = torch.arange(6.0)
    with HostWaits() as rec:
        float(x.sum())
        bool((x > 2).any())
        (x > 2).nonzero()
        x[x > 2]
        torch.equal(x, x)
        torch.bincount(x.long())
        torch.repeat_interleave(torch.tensor([1, 2]))
        # these do not wait
        torch.nonzero_static(x > 2, size=6)
        torch._assert_async((x >= 0).all(), "negative")
        x.cumsum(0).mul(2).where(x > 2, 0.0)
    names = [op.split(".")[1] for op, _, _ in rec.calls]
    assert names == ["_local_scalar_dense", "_local_scalar_dense", "nonzero", "index",
                     "equal", "bincount", "repeat_interleave"], names


@pytest.mark.parametrize("optimizer, waits", [("adamw", 0), ("radam", 1)])
def test_fp16_loss_scaling_waits_once_a_step_unless_the_optimizer_is_fused(
        tmp_path, corpus, device, optimizer, waits):
    """fp16's loss scaler skips a step whose gradients overflowed: torch's GradScaler reads
    that flag back (one wait a step) unless the optimiser takes it on the device, as the
    fused AdamW does (train.optimizer_impl=auto on CUDA); torch has no fused RAdam. fp16
    needs CUDA: on the CPU the run is fp32 with the scaler turned on, the same logic."""
    steps = 2
    precision = "fp16" if device.type == "cuda" else "fp32"
    cfg = config(corpus, f"train.optimizer={optimizer}", f"train.precision={precision}",
                 f"train.device={device.type}", "train.max_steps=100", "train.log_every=50",
                 "train.save_every=50", "train.eval_every=50",
                 *(["train.optimizer_impl=fused"] if optimizer == "adamw" else []))
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    try:
        if device.type == "cpu":
            trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        counts, where = _waits_in_steps(trainer, steps)
    finally:
        trainer.close()
    expected = collections.Counter({"aten._local_scalar_dense.default": waits * steps})
    assert counts == +expected, "\n".join(f"{op}: {w}" for op, w in where)


def test_the_transformer_keeps_its_window_on_the_host(corpus):
    """On any device (here the meta device, standing in for a GPU) the transformer's
    state keeps the window it reads every forward on the host, and its forward
    never reads a value from the model's device."""
    from srupp.models import build_model

    cfg = baseline_config(corpus, "transformer", "model.mem_len=8")
    model = build_model(cfg.model_config(256), device="meta")
    state = model.backbone.initial_state(2)
    assert state["window"].device.type == "cpu" and state["pos"].device.type == "meta"
    tokens = torch.zeros(2, 5, dtype=torch.long, device="meta")
    out = model(tokens, state)  # a read from a meta tensor would raise
    assert out.state["window"].device.type == "cpu"
