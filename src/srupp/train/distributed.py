"""Training on several processes: torchrun and ``torch.distributed``, nothing written here.

``torchrun --nproc_per_node N -m srupp train RECIPE`` starts N copies of the
trainer; each finds its rank in the environment torchrun sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``) and joins the process group: gloo on CPU,
NCCL on CUDA (``train.dist_backend`` overrides either), each rank on
``cuda:LOCAL_RANK`` on GPUs. Without torchrun, :func:`setup` returns the
single-process :data:`SINGLE` and nothing else changes.

What the ranks share, and how (the trainer's side is in :mod:`.trainer`):

* ``train.batch_size`` and ``train.max_tokens`` are global. The LM splits its
  streams across ranks; sentence tasks give each rank every W-th sentence of
  each global batch (:meth:`Dist.share`).
* Each step, every rank gets the global counts, a stop request (a signal
  seen by any rank) and rank 0's step time (:meth:`Dist.step_sums`), so every
  rank fits the same schedule and stops at the same step. Those are host
  numbers, summed on the CPU (beside NCCL, in a gloo group of their own), so
  that no rank waits for its GPU; the loss sums stay on the device and are
  summed there (:meth:`Dist.sum_on_device`), read only when the trainer logs.
* Evaluation is split across ranks and gathered in order
  (:meth:`Dist.map_shares`), so every rank computes the same metric.
* Rank 0 writes checkpoints and metrics; the others wait at a barrier.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ..errors import UserError

# the variables torchrun sets in every worker
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Dist:
    """This process's place in the job (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # beside NCCL: a gloo group for :meth:`sum`'s host numbers (None: the default group)
    host_group: Optional[Any] = field(default=None, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        """Several processes train together."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: it writes checkpoints, metrics and progress."""
        return self.rank == 0

    # ---------------------------------------------------------------- data
    def share(self, items: Sequence[Any]) -> List[Any]:
        """This rank's items of a global batch: every ``world_size``-th, from ``rank``."""
        return list(items[self.rank::self.world_size])

    def map_shares(self, fn: Callable[[List[Any]], List[Any]], items: Sequence[Any]) -> List[Any]:
        """``fn(items)`` computed in shares: each rank maps its :meth:`share`, one
        result per item, and every rank gets all results in ``items``' order."""
        if not self.enabled:
            return list(fn(list(items)))
        mine = list(fn(self.share(items)))
        if len(mine) != len(self.share(items)):
            raise RuntimeError("map_shares: fn must return one result per item")
        parts: List[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, mine)
        out: List[Any] = [None] * len(items)
        for r, part in enumerate(parts):
            out[r::self.world_size] = part
        return out

    # --------------------------------------------------------- collectives
    def sum(self, values: Sequence[float]) -> List[float]:
        """Host numbers, each summed over ranks (in float64).

        On the CPU, in :attr:`host_group` or a gloo default group: through NCCL
        they would be copied to the GPU and read back, which waits for every
        kernel queued before them.
        """
        if not self.enabled:
            return [float(v) for v in values]
        device = torch.device("cpu") if self.host_group is not None else self._collective_device()
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, group=self.host_group)
        return t.tolist()

    def sum_on_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over ranks, without reading it: under NCCL a CUDA tensor is
        reduced by the GPUs, in their queue. (A CUDA tensor under gloo is copied to
        the CPU for it, which waits.) Returns a new tensor on ``t``'s device."""
        if not self.enabled:
            return t
        out = t.to(self._collective_device(), copy=True)  # all_reduce works in place
        torch.distributed.all_reduce(out)
        return out.to(t.device)

    def step_sums(self, loss_sum: torch.Tensor, count: int, tokens: int, stop: bool,
                  seconds: float) -> Tuple[torch.Tensor, int, int, bool, float]:
        """A training step's numbers over all ranks: the sums of ``loss_sum`` (on its
        device), ``count`` and ``tokens``; whether any rank was asked to ``stop``; rank
        0's ``seconds``. So every rank logs the same loss, fits the same schedule and
        stops at the same step."""
        if not self.enabled:
            return loss_sum, count, tokens, stop, seconds
        loss_sum = self.sum_on_device(loss_sum)
        count, tokens, stops, seconds = self.sum(
            [count, tokens, float(stop), seconds if self.is_main else 0.0])
        return loss_sum, int(count), int(tokens), stops > 0, seconds

    def gather_objects(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        parts: List[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, obj)
        return parts

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def _collective_device(self) -> torch.device:
        backend = torch.distributed.get_backend()
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")


SINGLE = Dist()


def launched_by_torchrun() -> bool:
    """Whether torchrun (or another launcher that sets its variables) started us."""
    return all(k in os.environ for k in _ENV)


def setup(device: str = "cpu", backend: str = "auto", timeout_s: float = 300.0) -> Dist:
    """Join the process group torchrun describes, or :data:`SINGLE` without torchrun.

    ``device`` is ``train.device``; on CUDA each rank takes ``cuda:LOCAL_RANK``.
    ``timeout_s`` bounds a collective that waits for a rank that died.
    """
    if not launched_by_torchrun():
        return SINGLE
    try:
        rank, world, local = (int(os.environ[k]) for k in _ENV)
    except ValueError:
        raise UserError(f"torchrun's RANK, WORLD_SIZE and LOCAL_RANK must be integers, got "
                        f"{', '.join(os.environ[k] for k in _ENV)}") from None
    dist = Dist(rank, world, local)
    if not dist.enabled:
        return dist  # torchrun with one process: nothing to join
    backend = choose_backend(device, backend)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("train.device=cuda but no CUDA device is available; "
                            "use train.device=cpu")
        torch.cuda.set_device(local)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not torch.distributed.is_initialized():
        try:
            torch.distributed.init_process_group(backend, timeout=timeout)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"cannot start the {backend!r} process group "
                            f"({str(e).splitlines()[0]}); check train.dist_backend") from None
    if torch.distributed.get_backend() != "gloo":
        # every rank makes it, in the same order: new_group is a collective
        host_group = torch.distributed.new_group(backend="gloo", timeout=timeout)
        dist = Dist(rank, world, local, host_group=host_group)
    return dist


def choose_backend(device: str, backend: str = "auto") -> str:
    """The process group's backend: ``backend`` unless "auto", which is NCCL for
    ``train.device=cuda`` and gloo for the CPU (NCCL reduces only CUDA tensors)."""
    if backend != "auto":
        return backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def teardown(dist: Dist, *, wait_for_all: bool = True) -> None:
    """Leave the process group (after the last collective).

    ``wait_for_all`` first meets every rank at a barrier, so that no rank shuts
    its connections while another still reads from them (gloo could abort a
    rank at exit that way). Pass False after a failure, when a rank may be gone.
    """
    if dist.enabled and torch.distributed.is_initialized():
        if wait_for_all:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        gc.collect()  # drop work objects that still hold tensors while Python is whole


def die_with_launcher(poll_s: float = 0.5) -> None:
    """Exit at once when the torchrun process that started us dies.

    torchrun starts its workers in a session of their own, so a SIGKILL to
    torchrun reaches none of them, and they would train on into the run
    directory. The kernel's parent-death signal covers Linux; a thread that
    polls the parent's pid covers the rest (and a parent that died before
    the signal was armed).
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    if parent == 1:
        os._exit(1)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)  # no cleanup: the launcher is gone, write nothing more
            threading.Event().wait(poll_s)

    threading.Thread(target=watch, name="srupp-launcher-watchdog", daemon=True).start()


# ------------------------------------------------------------------------------- FSDP2
def fully_shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """Shard ``model`` in place with FSDP2: each layer of every ``nn.ModuleList``
    (the model's stacks), then the rest (embeddings, output) at the root.

    Gradients are reduced as a sum, then divided by the world size: gloo's
    averaging reduction has been reported to sum (pytorch#162338), and this
    way no backend needs it.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    layers = [m for parent in model.modules() if isinstance(parent, torch.nn.ModuleList)
              for m in parent]
    for layer in reversed(layers):  # inner stacks before the ones that hold them
        if any(p.requires_grad for p in layer.parameters()) and not isinstance(layer,
                                                                              FSDPModule):
            fully_shard(layer, mesh=mesh)
            if hasattr(layer, "layer_forward"):
                # the recurrent stacks call their layers through this method, not
                # forward: FSDP must gather the layer's weights around it too
                register_fsdp_forward_method(layer, "layer_forward")
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def whole_weights(model: torch.nn.Module) -> dict:
    """The whole (unsharded) weights of a sharded model, on every rank. A collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_shards(model: torch.nn.Module, optimizer) -> dict:
    """This rank's shards of a sharded model's weights and optimiser state, as
    plain CPU tensors keyed by parameter name (for an exact resume at the
    same world size)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = {"param": _local(p.detach()).cpu().clone(),
                     "state": {k: _local(v).cpu().clone() if torch.is_tensor(v) else v
                               for k, v in optimizer.state.get(p, {}).items()}}
    return out


def load_local_shards(model: torch.nn.Module, optimizer, shards: dict) -> None:
    """Put back what :func:`local_shards` saved, in place: FSDP gathers its weights
    from the very buffers the shards live in, so they are copied into, not replaced."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    if set(params) != set(shards):
        raise ValueError("the saved shards are of another model; resume with the same model")
    with torch.no_grad():
        for name, p in params.items():
            saved = shards[name]
            _local(p).copy_(saved["param"])
            state = {}
            for k, v in saved["state"].items():
                if torch.is_tensor(v) and isinstance(p, DTensor) and v.shape == _local(p).shape \
                        and v.dim() > 0:  # a moment estimate, sharded like its parameter
                    v = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                           shape=p.shape, stride=p.stride())
                elif torch.is_tensor(v):
                    v = v.to(p.device) if v.dim() > 0 else v.clone()
                state[k] = v
            if state:
                optimizer.state[p] = state
