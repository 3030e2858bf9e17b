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
* One small all-reduce per step carries the loss sums, counts, a stop
  request (a signal seen by any rank) and rank 0's step time, so every rank
  logs the same loss and stops at the same step.
* Evaluation is split across ranks and gathered in order
  (:meth:`Dist.map_shares`), so every rank computes the same metric.
* Rank 0 writes checkpoints and metrics; the others wait at a barrier.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence

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
        """Each value summed over ranks (float64, on the CPU: gloo, or NCCL's CPU side)."""
        if not self.enabled:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                         device=self._collective_device())
        torch.distributed.all_reduce(t)
        return t.tolist()

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
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("train.device=cuda but no CUDA device is available; "
                            "use train.device=cpu")
        torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        try:
            torch.distributed.init_process_group(
                backend, timeout=datetime.timedelta(seconds=timeout_s))
        except (ValueError, RuntimeError) as e:
            raise UserError(f"cannot start the {backend!r} process group "
                            f"({str(e).splitlines()[0]}); check train.dist_backend") from None
    return dist


def teardown(dist: Dist) -> None:
    """Leave the process group (after the last collective)."""
    if dist.enabled and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


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
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    layers = [m for parent in model.modules() if isinstance(parent, torch.nn.ModuleList)
              for m in parent]
    for layer in reversed(layers):  # inner stacks before the ones that hold them
        if any(p.requires_grad for p in layer.parameters()) and not isinstance(layer,
                                                                              FSDPModule):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(model: torch.nn.Module, optimizer) -> tuple:
    """The whole (unsharded) model and optimiser state of a sharded model, on the
    CPU of rank 0 (empty elsewhere). A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    weights = get_model_state_dict(model, options=_options(cpu_offload=True))
    opt = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    return weights, opt


def load_full_state(model: torch.nn.Module, optimizer, weights: dict, opt: dict) -> None:
    """Give a sharded model and its optimiser the whole state rank 0 read
    (``{}`` on the other ranks): each rank keeps its shard. A collective."""
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)

    set_model_state_dict(model, weights, options=_options(broadcast_from_rank0=True))
    set_optimizer_state_dict(model, optimizer, opt, options=_options(broadcast_from_rank0=True))
