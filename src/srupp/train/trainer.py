"""The trainer of every task: the training loop, over one run directory, with exact resume.

The task (:mod:`srupp.train.tasks`: language modelling, translation or
classification) supplies the data, batches, loss and evaluation; the loop is
the same for all. In order: accumulate gradients over ``grad_accum``
micro-batches (a language model carries its state across segments,
detached), clip, step the optimiser (``train.optimizer``: RAdam or AdamW,
:func:`build_optimizer`), step the learning rate (:mod:`.schedule`, which
also fits the run's length to a time budget); log every ``log_every`` steps
(:mod:`.metrics`), validate every ``eval_every``, checkpoint every
``save_every`` (:mod:`.checkpoint`). Everything a resumed run needs is in the
checkpoint: weights, optimiser, schedule (with its length), RNG, data
position, the carried state and the partial loss sums of the current log
interval.

Ctrl-C (SIGINT) and SIGTERM stop the run between two optimiser steps
(:mod:`.signals`): the loop saves and returns at the next step boundary, so a
resumed run continues bit for bit. A second signal stops at once, without
saving: the last checkpoint stays, as after SIGKILL.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from .._extras import MissingExtra
from .._files import atomic_write_json
from .._format import with_format_version
from ..errors import UserError
from ..models import build_model
from ..models.base import load_weights
from ..models.state import state_from_dict
from ..ops import cpu_has_native_bf16, warm_up
from ..runs import (MODEL_FILE, RUN_CONFIG, TRAINER_STATE, has_checkpoint, pointer_step,
                    read_run_config, read_run_files, resolve_checkpoint)
from .checkpoint import (check_same_shape, load_carried_state, load_trainer_state,
                         save_checkpoint)
from .compile import compile_layers
from .config import RunConfig, TrainConfig, has_fused
from .device import synchronize
from .distributed import SINGLE, Dist
from .lock import LOCK_FILE, trainer_lock
from .metrics import MetricsLog
from .plots import run_curves
from .schedule import StepSchedule
from .signals import StopRequests


class Trainer:
    """Train the model of ``cfg.task`` and ``model.type`` into ``run_dir``.

    Args:
        cfg: the run configuration.
        run_dir: where checkpoints, metrics and plots go.
        resume: continue from ``run_dir``'s last checkpoint.
        progress: show a tqdm progress bar on stderr.
        dist: this process's rank in a torchrun job (:func:`srupp.train.distributed.setup`);
            rank 0 writes the run directory, every rank trains its share.

    The trainer (rank 0) holds the run directory's lock (:mod:`srupp.train.lock`)
    from its construction until :meth:`train` returns or :meth:`close` is
    called: another trainer or process on the directory is refused
    (``UserError`` naming the holder's PID). A resumed run that had already
    finished its budget sets :attr:`finished_at` and writes nothing; a raised
    ``train.max_steps`` or ``train.max_seconds`` continues it.

    With ``train.tensorboard``, rank 0 also writes the metrics for TensorBoard
    (:mod:`srupp.train.metrics`).

    Raises:
        OSError: a write failed (a full disk): it names the file; the last
            complete checkpoint stays the one ``resume`` takes.
    """

    def __init__(self, cfg: RunConfig, run_dir, *, resume: bool = False, progress: bool = True,
                 dist: Dist = SINGLE):
        self.cfg = cfg
        self.dist = dist
        self.run_dir = Path(run_dir)
        self.progress = progress and dist.is_main
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = (torch.device("cuda", dist.local_rank)
                       if dist.enabled and t.device == "cuda" else torch.device(t.device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UserError("train.device=cuda but no CUDA device is available; use train.device=cpu")
        self.precision = t.precision
        if self.precision == "fp16" and self.device.type != "cuda":
            raise UserError("train.precision=fp16 needs CUDA; on CPU use bf16 or fp32")
        if self.precision == "bf16" and self.device.type == "cpu" and not cpu_has_native_bf16():
            warnings.warn("this CPU has no native bf16; training in fp32 instead", stacklevel=2)
            self.precision = "fp32"

        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise UserError(f"{self.run_dir} is a file, not a run directory; "
                            f"choose another --out")
        self._lock = None  # rank 0's lock on the run directory (srupp.train.lock)
        self._locked = False  # held, by self._lock or by a block of this process around it
        self.finished_at: Optional[int] = None
        self.finished = False  # the final evaluation is saved
        self.schedule = StepSchedule(t)
        # rank 0 writes the metrics; a missing tensorboard is said before any slow work
        self.metrics = MetricsLog(self.run_dir, tensorboard=t.tensorboard and dist.is_main)
        self._stop = StopRequests()
        created = False
        try:
            self._take_lock()  # before reading a checkpoint that another writer may replace
            ckpt = saved_state = None
            if resume:
                ckpt = resolve_checkpoint(self.run_dir, prefer="last")
                saved_state = load_trainer_state(ckpt)
                try:
                    self.finished_at = self._finished_at(saved_state)
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    raise UserError(f"{ckpt / TRAINER_STATE} does not fit this run "
                                    f"({type(e).__name__}: {e})") from None
                self.finished = self.finished_at is not None  # nothing to train or write
            elif has_checkpoint(self.run_dir):
                raise UserError(f"{self.run_dir} already holds a run; pass --resume to "
                                f"continue it or choose another --out")
            # every rank has checked the directory before rank 0 creates it
            dist.barrier()
            created = dist.is_main and not resume and not self.run_dir.is_dir()
            if created:  # before any slow work
                try:
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise UserError(f"cannot create the run directory {self.run_dir}: "
                                    f"{e.strerror or e}") from None
                self._take_lock()
            if self._lock is not None and not self.finished:
                self._lock.write_pid()
            self._set_up(cfg, ckpt, saved_state)
            if self.finished:  # it writes nothing: another process may take the run now
                self.close()
        except BaseException:
            if created:  # leave nothing behind for a run that never started
                with contextlib.suppress(OSError):
                    (self.run_dir / LOCK_FILE).unlink()
            self.close()
            if created:
                with contextlib.suppress(OSError):
                    self.run_dir.rmdir()  # only if still empty
            raise

    def _take_lock(self) -> None:
        """Rank 0: lock the run directory (if it exists yet), unless already locked."""
        if self.dist.is_main and not self._locked and self.run_dir.is_dir():
            self._lock = trainer_lock(self.run_dir)
            self._locked = True

    def close(self) -> None:
        """Release the run directory's lock; :meth:`train` does so when it ends.

        Another trainer (or process) may then write the run. Calling
        :meth:`train` again takes the lock again.
        """
        if self._lock is not None:
            self._lock.release()
        self._lock, self._locked = None, False

    @property
    def finished_message(self) -> Optional[str]:
        """For a resumed run that had already used its budget: what to do to continue it."""
        if self.finished_at is None:
            return None
        return (f"run {self.run_dir} finished at step {self.finished_at}; raise "
                f"train.max_steps or train.max_seconds to continue")

    @property
    def total_steps(self) -> int:
        """The step the run trains to (fitted to ``train.max_seconds`` when that is set)."""
        return self.schedule.total_steps

    # ---------------------------------------------------------------- budget
    def _finished_at(self, state: Dict[str, Any]) -> Optional[int]:
        """The step at which a checkpoint's run finished, when this run's budget leaves it
        nothing to train; else None."""
        if not state["finished"]:
            return None
        if self.schedule.budget_raised(state["budget"]):
            extended = StepSchedule(self.cfg.train)
            extended.load_state_dict(state)
            extended.extend(state["step"], state["train_seconds"])
            t = self.cfg.train
            if state["step"] < extended.total_steps and (
                    t.max_seconds is None or state["train_seconds"] < t.max_seconds):
                return None  # a raised budget leaves steps to train
        return int(state["step"])

    def _extend_budget(self) -> None:
        """A resumed run with a raised budget: train on to it; its config.json says so, so
        that a later --resume keeps it."""
        self.schedule.extend(self.step, self.train_seconds)
        if self.dist.is_main:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError, UserError):
                saved = read_run_config(self.run_dir)
                saved["train"].update(self.schedule.budget)
                atomic_write_json(self.run_dir / RUN_CONFIG, with_format_version(saved))

    def _set_up(self, cfg: RunConfig, ckpt: Optional[Path],
                saved_state: Optional[Dict[str, Any]] = None) -> None:
        t = cfg.train
        # ---- data, tokenizer (and labels)
        self.task = cfg.task_class(cfg, self.dist)
        saved = None
        if ckpt is not None:
            saved = read_run_files(self.run_dir, self.task.file_names)
        if self.dist.enabled and saved is None:
            # rank 0 builds the tokenizer (and labels); the others take its files, so
            # that every rank has the same vocabulary however the builder behaves
            if self.dist.is_main:
                self.task.load(None)
            saved = self.dist.broadcast_object(self.task.files() if self.dist.is_main else None)
            if not self.dist.is_main:
                self.task.load(saved)
        else:
            self.task.load(saved)
        self.model_config = self.task.model_config
        if ckpt is not None:
            check_same_shape(self.run_dir, ckpt, self.model_config)
        self.metric = self.task.metric
        self.batcher = self.task.batcher

        # ---- model, optimiser, schedule
        torch.manual_seed(t.seed)
        self.model = build_model(self.model_config, device=self.device)
        if self.dist.enabled:
            torch.manual_seed(t.seed + self.dist.rank)  # each rank its own dropout masks
        self.train_model = self._wrap(self.model)
        self.optimizer = build_optimizer(self._param_groups(), t)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: self.schedule.lr_factor(s))
        # disabled (every call a no-op or a plain optimizer.step()) unless fp16; its scale
        # and growth count are saved with every checkpoint (_trainer_state) and put back
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

        self.step = 0
        self.train_seconds = 0.0
        self.tokens_seen = 0  # tokens read by training steps (lm: inputs; translate: targets)
        self.carried = None
        self.best_loss = float("inf")  # the best validation loss (nats per token)
        # translation and classification: the best validation BLEU or macro-F1
        self.best_metric = float("-inf")
        self.interval = _new_interval()
        self._mid_step = False  # inside an optimiser step: the state is not consistent
        if ckpt is not None:
            self._restore(ckpt, saved_state)
        elif self.dist.is_main:
            atomic_write_json(self.run_dir / RUN_CONFIG, with_format_version(cfg.to_dict()))
            for name, content in self.task.files().items():
                atomic_write_json(self.run_dir / name, content)
            # lines of a run killed before its first checkpoint: it starts again from step 0
            self.metrics.truncate(0)
        self.dist.barrier()

    @property
    def sharded(self) -> bool:
        """FSDP2: each rank holds a shard of the weights and optimiser state."""
        return self.dist.enabled and self.cfg.train.shard == "fsdp"

    def _wrap(self, model):
        """The module the training steps call: DDP under torchrun (or FSDP2 in place, with
        train.shard=fsdp), compiled with train.compile.

        ``train.compile=layers`` compiles each layer in place first, so that FSDP's
        gathers stay around the compiled layer, outside it (:func:`compile_layers`)."""
        t = self.cfg.train
        if t.compile in ("layers", "layers-cudagraphs"):
            if not compile_layers(model, cudagraphs=t.compile == "layers-cudagraphs"):
                kind = self.cfg.model.get("type", "srupp")
                raise UserError(f"train.compile={t.compile} compiles the repeated layers of "
                                f"SRU, SRU++ and Transformer backbones; model.type={kind} has "
                                f"none: use train.compile=model or off")
        if self.sharded:
            from .distributed import fully_shard_model

            fully_shard_model(model, self.device)
        elif self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # the model has no buffers that change in training: nothing to broadcast per step
            model = DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)
        if t.compile == "model":
            model = torch.compile(model)
        return model

    # ----------------------------------------------------------------- setup
    @property
    def tokenizer(self):
        return self.task.tokenizer

    def _param_groups(self):
        if not self.cfg.train.no_decay_bias_norm:
            return [{"params": list(self.model.parameters())}]
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if p.dim() >= 2 and "weight_c" not in name else no_decay).append(p)
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    def _trainer_state(self) -> Dict[str, Any]:
        return {
            **{k: getattr(self, k) for k in ("step", "train_seconds", "best_loss", "best_metric",
                                             "tokens_seen")},
            **self.schedule.state_dict(),  # total_steps, calibrated, refitted, calibrated_at
            "interval": {**self.interval, "loss_sum": float(self.interval["loss_sum"])},
            # under FSDP each rank's shard of the state is in "ranks" (_rank_states); the
            # groups' settings (the current lr among them) are kept here
            "optimizer": ({"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                            for g in self.optimizer.param_groups]}
                          if self.sharded else self.optimizer.state_dict()),
            "optimizer_name": self.cfg.train.optimizer,  # a resume must build the same one
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
            "data": self.batcher.state_dict(),
            "world_size": self.dist.world_size,
            "shard": self.cfg.train.shard if self.dist.enabled else None,
            # a resumed run compares its budget with these: the same, it has nothing to do
            "budget": self.schedule.budget,
            "finished": self.finished,
            # a resumed run keeps these lines of metrics.jsonl and drops the rest
            "metrics_lines": self.metrics.lines,
        }

    def _rank_states(self) -> Optional[Dict[str, Any]]:
        """Every rank's RNG (and carried LM state), gathered for rank 0 to save."""
        if not self.dist.enabled:
            return None
        cuda = torch.cuda.get_rng_state() if self.device.type == "cuda" else None
        mine = {"rng": torch.get_rng_state(), "cuda_rng": cuda,
                "data": self.batcher.state_dict(),  # names its rank: each has its own
                "carried": None if self.carried is None else self.carried.to_dict()}
        if self.sharded:  # this rank's shards of the weights and optimiser state
            from .distributed import local_shards

            mine["shards"] = local_shards(self.model, self.optimizer)
        return {"ranks": self.dist.gather_objects(mine)}

    def _restore(self, ckpt: Path, state: Optional[Dict[str, Any]] = None) -> None:
        if state is None:
            state = load_trainer_state(ckpt)
        saved_world = state["world_size"]
        if saved_world != self.dist.world_size:
            raise UserError(f"{self.run_dir} was trained on {saved_world} process(es), this run "
                            f"has {self.dist.world_size}; resume it at world size {saved_world} "
                            f"(torchrun --nproc_per_node), or train a new run into another --out")
        shard = self.cfg.train.shard if self.dist.enabled else None
        if state["shard"] != shard:
            raise UserError(f"{self.run_dir} was trained with train.shard={state['shard']}; "
                            f"resume it with the same setting")
        # another optimiser would load the saved moments without complaint and train on
        # from state it never made (checkpoints before train.optimizer were all RAdam's)
        saved_optimizer = state.get("optimizer_name", "radam")
        if saved_optimizer != self.cfg.train.optimizer:
            raise UserError(f"{self.run_dir} was trained with train.optimizer={saved_optimizer}; "
                            f"resume it with the same setting, or train a new run into "
                            f"another --out")
        try:
            if not self.sharded:  # FSDP: each rank's shards come from trainer.pt, below
                load_weights(self.model, ckpt / MODEL_FILE, device=self.device)
        except Exception as e:
            raise UserError(f"{ckpt / MODEL_FILE} is truncated or corrupt or does "
                            f"not fit the config ({str(e).splitlines()[0][:200]})") from None
        try:
            if self.sharded:
                from .distributed import load_local_shards

                load_local_shards(self.model, self.optimizer,
                                  state["ranks"][self.dist.rank]["shards"])
                for group, saved in zip(self.optimizer.param_groups,
                                        self._this_impl(state["optimizer"]["param_groups"]),
                                        strict=True):
                    group.update(saved)
            else:
                saved = state["optimizer"]
                self.optimizer.load_state_dict(
                    {**saved, "param_groups": self._this_impl(saved["param_groups"])})
            self.scheduler.load_state_dict(state["scheduler"])
            self.batcher.load_state_dict(state["ranks"][self.dist.rank]["data"]
                                         if self.dist.enabled else state["data"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise UserError(f"{ckpt / TRAINER_STATE} does not fit this run ({e})") from None
        if self.scaler.is_enabled() and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        for k in ("step", "train_seconds", "tokens_seen", "best_loss", "best_metric"):
            setattr(self, k, state[k])
        self.schedule.load_state_dict(state)
        if not self.finished and self.schedule.budget_raised(state["budget"]):
            self._extend_budget()
        self.interval = dict(state["interval"])
        if self.dist.enabled:
            mine = state["ranks"][self.dist.rank]
            torch.set_rng_state(mine["rng"])
            if mine["cuda_rng"] is not None:
                torch.cuda.set_rng_state(mine["cuda_rng"])
            carried = (None if mine["carried"] is None
                       else state_from_dict(mine["carried"]))
        else:
            torch.set_rng_state(state["rng"])
            if state["cuda_rng"]:
                torch.cuda.set_rng_state_all(state["cuda_rng"])
            carried = load_carried_state(ckpt) if self.task.carries_state else None
        self.carried = None if carried is None else carried.to(self.device)
        if self.dist.is_main and not self.finished:
            self.metrics.truncate(self.step, state["metrics_lines"])

    def _this_impl(self, saved_groups) -> list:
        """A checkpoint's optimiser groups with this run's ``train.optimizer_impl`` flags.

        The implementations keep the same state, and a resume may change the
        implementation (a GPU run compares them); but loading a state dict
        also loads its groups' ``fused`` and ``foreach`` flags, which would
        silently bring the saved implementation back.
        """
        flags = [{k: g[k] for k in IMPL_FLAGS if k in g} for g in self.optimizer.param_groups]
        if len(flags) != len(saved_groups):
            return list(saved_groups)  # load_state_dict names the mismatch
        return [{**saved, **mine} for saved, mine in zip(saved_groups, flags)]

    # --------------------------------------------------------------- logging
    def _log(self, record: Dict[str, Any]) -> None:
        if self.dist.is_main:
            self.metrics.append(record)

    # ------------------------------------------------------------------ loop
    def _train_step(self, it) -> tuple:
        """One optimiser step; returns this rank's (loss sum, count, tokens).

        The loss sum is a float64 tensor on the device: the step reads nothing
        back from it (see :meth:`_wait_for_device`).
        """
        t = self.cfg.train
        model, count, tokens = self.train_model, 0, 0
        if t.compile == "layers-cudagraphs":
            # a new step: the CUDA graphs may reuse the memory of the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._mid_step = True
        # micro-batches of sentences hold different numbers of tokens (and so do the
        # ranks' shares of a batch): weight each by its count, so that the step's
        # gradient is the mean over all of them
        by_count = self.task.weighted_accumulation and (t.grad_accum > 1 or self.dist.enabled)
        for micro in range(t.grad_accum):
            # DDP averages gradients across ranks once, after the last micro-batch
            last = micro == t.grad_accum - 1
            if self.sharded:
                model.set_requires_gradient_sync(last)
            sync = (contextlib.nullcontext() if last or not self.dist.enabled or self.sharded
                    else model.no_sync())
            with sync:
                loss, part_sum, part_count, part_tokens, self.carried = self.task.loss(
                    model, next(it), self.carried, self.device, self.precision)
                if by_count:
                    loss = loss * part_count
                elif t.grad_accum > 1:
                    loss = loss / t.grad_accum
                self.scaler.scale(loss).backward()
            loss_sum += part_sum
            count += part_count
            tokens += part_tokens
        self.scaler.unscale_(self.optimizer)
        if by_count:
            # DDP averaged over ranks: the global mean divides by the global count / W
            total = self.dist.sum([count])[0] if self.dist.enabled else count
            scale = self.dist.world_size / max(total, 1)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale) if self.dist.enabled else p.grad.div_(max(count, 1))
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.interval["loss_sum"] += loss_sum
        self.interval["count"] += count
        self.interval["tokens"] += tokens
        self.tokens_seen += tokens
        self._mid_step = False
        return loss_sum, count, tokens

    def _account(self, loss_sum: torch.Tensor, count: int, tokens: int, dt: float) -> tuple:
        """Add the step's time, and under torchrun make its sums global.

        ``_train_step`` added this rank's sums to the interval; under torchrun
        the sums over all ranks replace them (:meth:`Dist.step_sums`).
        Returns (mean loss of the step (a device tensor), step seconds, stop requested).
        """
        local = (loss_sum, count, tokens)
        loss_sum, count, tokens, stop, dt = self.dist.step_sums(
            loss_sum, count, tokens, bool(self._stop.count), dt)
        if self.dist.enabled:
            self.interval["loss_sum"] += loss_sum - local[0]
            self.interval["count"] += count - local[1]
            self.interval["tokens"] += tokens - local[2]
            self.tokens_seen += tokens - local[2]
        self.train_seconds += dt
        self.interval["seconds"] += dt
        return loss_sum / max(count, 1), dt, stop

    @property
    def _runs_ahead(self) -> bool:
        """The host only queues the device's work (CUDA), so a step's host time is not its own."""
        return self.device.type == "cuda"

    def _wait_for_device(self, start: float, refresh_bar: bool) -> bool:
        """On CUDA, wait for the step's work before its time is taken, where it is read.

        The host queues a CUDA step and goes on; its own time is that of the
        launches. Over many steps the times still add up to the GPU's (the host
        cannot run further ahead than CUDA's queue), but calibration needs
        each step's own time, and a re-fit the time up to its step. Logging,
        evaluation, saving and the progress bar read values back, which waits
        anyway; waiting here counts that work as training, not as logging.
        Other steps do not wait.

        Returns whether the step waited for a reason every rank shares (not
        this rank's progress bar or signal), so that under torchrun all ranks
        re-fit at the same step.
        """
        if not self._runs_ahead:
            return False
        t, s = self.cfg.train, self.step
        shared = (not self.schedule.calibrated
                  or self.schedule.refit_due(s, self.train_seconds) or s >= self.total_steps
                  or s % t.log_every == 0 or s % t.eval_every == 0 or s % t.save_every == 0)
        # the last step of the budget; under torchrun only rank 0's time counts
        ends_budget = (t.max_seconds is not None
                       and self.train_seconds + time.perf_counter() - start >= t.max_seconds)
        if shared or refresh_bar or self._stop.count or ends_budget:
            synchronize(self.device)
        return shared

    def validate(self, max_batches: Optional[int] = None, *, final: bool = False
                 ) -> Dict[str, float]:
        """The task's validation results: ``loss`` and its metrics."""
        model = self._whole_model() if self.sharded else self.model
        return self.task.validate(model, self.precision, final=final, max_batches=max_batches)

    def _whole_model(self):
        """Under FSDP: a plain model with the whole weights, on every rank (a collective).

        Evaluation and decoding call into layers in ways FSDP's hooks do not see
        (a decoder's step reads its layers' weights directly), and ranks decode
        different numbers of steps; a plain copy needs no collective per forward.
        """
        from .distributed import whole_weights

        if getattr(self, "_plain", None) is None:
            with torch.random.fork_rng(devices=[]):  # its init must not move the dropout RNG
                self._plain = build_model(self.model_config, device=self.device)
        self._plain.load_state_dict(whole_weights(self.model))
        self._plain.train(self.model.training)
        return self._plain

    def _save(self, pointers=("last",), info=None) -> None:
        """Rank 0 writes the checkpoint (with every rank's RNG and state); the others wait."""
        ranks = self._rank_states()  # collectives: every rank takes part
        # FSDP: the whole weights too, so that the folder serves eval and generate
        model = self._whole_model() if self.sharded else self.model
        if self.dist.is_main:
            state = self._trainer_state()
            if ranks is not None:
                state.update(ranks)
            save_checkpoint(self.run_dir, self.step, model,
                            None if self.dist.enabled else self.carried, state,
                            files=self.task.files(), pointers=pointers, info=info)
            self.metrics.flush()
        self.dist.barrier()

    def train(self) -> Dict[str, Any]:
        """Run to ``total_steps`` or the time budget; returns a summary.

        A resumed run that had already finished its budget (its final
        evaluation saved) returns at once, writing nothing, with
        ``"finished": True`` and the final evaluation's results
        (:attr:`finished_message` says how to continue it). The run directory
        is locked against other writers until this returns.

        SIGINT (Ctrl-C) and SIGTERM stop the run at the next step boundary: it
        saves a checkpoint there and returns ``{"interrupted": True, ...}``; a
        second signal stops at once without saving (the last checkpoint stays).
        The handlers are installed only while this runs, and only from the
        main thread; the previous ones come back afterwards.
        """
        if self.finished_at is not None:  # a resumed run with no budget left
            return self._finished_summary()
        try:
            if not self._locked:  # released by close() or an earlier train()
                self._take_lock()
                if self._lock is not None:
                    self._lock.write_pid()
            if self.dist.is_main:
                self.metrics.open(self.step)
            with self._stop:
                return self._train()
        finally:
            self.metrics.close()
            self.close()

    def _train(self) -> Dict[str, Any]:
        from tqdm import tqdm

        t = self.cfg.train
        self.model.train()
        # build compiled kernels before the clock starts (one-time compilation is not training)
        warm_up(self.device)
        it = self.batcher.iter_from(self.batcher.position)
        schedule, stop_requests = self.schedule, self._stop
        schedule.start()
        last_postfix = 0.0
        try:
            with tqdm(total=self.total_steps, initial=self.step, disable=not self.progress,
                      file=sys.stderr, dynamic_ncols=True, unit="step") as bar:
                stop = False
                while (self.step < self.total_steps and not stop
                       and not (stop_requests.count and not self.dist.enabled)
                       and (t.max_seconds is None or self.train_seconds < t.max_seconds)):
                    start = time.perf_counter()
                    sums = self._train_step(it)
                    now = time.monotonic()
                    # formatting every step costs measurable time
                    refresh = self.progress and now - last_postfix > 0.5
                    timed = self._wait_for_device(start, refresh)
                    loss, dt, stop = self._account(*sums, time.perf_counter() - start)
                    if not schedule.calibrated:
                        if schedule.calibrate(self.step, self.train_seconds, dt):
                            bar.total = self.total_steps
                    elif (schedule.refit_due(self.step, self.train_seconds)
                          and (timed or not self._runs_ahead)):
                        # (on CUDA a re-fit waits for a step that waited for the device)
                        schedule.refit(self.step, self.train_seconds)
                        bar.total = self.total_steps
                    bar.update(1)
                    tok_s = self.interval["tokens"] / max(self.interval["seconds"], 1e-9)
                    if refresh:
                        last_postfix = now
                        loss = float(loss)
                        left = (f"{max(0.0, t.max_seconds - self.train_seconds):.0f}s"
                                if t.max_seconds else "-")
                        # the task's own (a language model's loss in bpc or ppl) beside it
                        bar.set_postfix(loss=f"{loss:.3f}", **self.task.bar_value(loss),
                                        tok_s=f"{tok_s:.0f}", left=left, refresh=False)
                    if self.step % t.log_every == 0:
                        iv = self.interval
                        self._log({"step": self.step,
                                   "train_loss": float(iv["loss_sum"]) / max(iv["count"], 1),
                                   "lr": self.scheduler.get_last_lr()[0],
                                   "tokens_per_s": tok_s, "train_seconds": self.train_seconds})
                        self.interval = _new_interval()
                    if self.step % t.eval_every == 0:
                        self._evaluate_and_save(t.eval_max_batches)
                    elif self.step % t.save_every == 0:
                        self._save()
        except KeyboardInterrupt:
            # a second signal, or an interrupt raised by code around the trainer
            if self._mid_step or stop_requests.count > 1 or self.dist.enabled:
                # under torchrun the other ranks may be inside a collective: no save
                return self._stopped_without_saving()
            return self._stop_and_save()
        if stop or (stop_requests.count and not self.dist.enabled):
            return self._stop_and_save()
        final = self._evaluate_and_save(None, final=True)
        if self.dist.is_main:
            self.plot()
        summary = {"interrupted": False, "step": self.step}
        summary.update({f"valid_{k}": final[k] for k in self.task.summary_keys()})
        summary.update(train_seconds=self.train_seconds, params=self.model.num_parameters())
        return summary

    def _finished_summary(self) -> Dict[str, Any]:
        """The summary of a run that had finished before: its final evaluation's results
        (metrics.jsonl's last validation line)."""
        summary = {"interrupted": False, "finished": True, "step": self.step}
        final = next((r for r in reversed(self.metrics.rows())
                      if "valid_loss" in r and r.get("step") == self.step), {})
        summary.update({f"valid_{k}": final.get(f"valid_{k}") for k in self.task.summary_keys()})
        summary.update(train_seconds=self.train_seconds, params=self.model.num_parameters())
        return summary

    def _stop_and_save(self) -> Dict[str, Any]:
        self._save()
        if self.dist.is_main:
            print(f"interrupted: saved step {self.step} to {self.run_dir}; "
                  f"continue with --resume", file=sys.stderr)
        return {"interrupted": True, "step": self.step}

    def _stopped_without_saving(self) -> Dict[str, Any]:
        """Stopped inside a step: keep the last checkpoint, the state in memory is half-updated."""
        step = pointer_step(self.run_dir, "last")
        where = (f"continue from its last checkpoint (step {step}) with --resume"
                 if step is not None else "no checkpoint was saved yet")
        if self.dist.is_main:
            print(f"interrupted at once: nothing saved; {where}", file=sys.stderr)
        return {"interrupted": True, "step": step}

    def _evaluate_and_save(self, max_batches, *, final: bool = False) -> Dict[str, float]:
        res = self.validate(max_batches, final=final)
        # saved with the checkpoint: a --resume with the same budget has nothing to do
        self.finished = final
        record = {"step": self.step}
        record.update({f"valid_{k}": v for k, v in res.items()})
        record["train_seconds"] = self.train_seconds
        self._log(record)
        pointers = ["last"]
        # the best checkpoint: by validation loss for language models; by the task's
        # metric (BLEU, macro-F1) for the others, where the loss can rise while it improves
        if self.task.higher_is_better:
            better = res[self.metric] > self.best_metric
        else:
            better = res["loss"] < self.best_loss
        self.best_loss = min(self.best_loss, res["loss"])
        if better:
            if self.task.higher_is_better:
                self.best_metric = res[self.metric]
            pointers.append("best")
        info = {"valid_loss": res["loss"]}
        if self.metric in res:
            info[f"valid_{self.metric}"] = res[self.metric]
        self._save(tuple(pointers), info=info)
        return res

    def plot(self) -> Optional[Path]:
        """Write ``curves.png`` (:func:`srupp.train.plots.run_curves`); without matplotlib,
        a warning names the extra and nothing is written."""
        try:
            return run_curves(self.run_dir / "curves.png", self.metrics.rows(), self.metric)
        except MissingExtra as e:
            warnings.warn(f"{e}; the run is saved, without curves.png", stacklevel=2)
            return None


def build_optimizer(param_groups, t: TrainConfig) -> torch.optim.Optimizer:
    """``train.optimizer`` over ``param_groups``, with ``train.lr``, ``train.betas`` and
    ``train.weight_decay`` (a group's own ``weight_decay`` wins), in the implementation
    ``train.optimizer_impl`` picks for the parameters' device (:func:`optimizer_impl`).

    Both decay the weights decoupled from the gradient (AdamW-style), so that
    switching optimiser keeps the meaning of ``train.weight_decay``.
    """
    groups = list(param_groups)
    first = next((p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])),
                 None)
    device = first.device if first is not None else torch.device("cpu")
    common = dict(lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay,
                  **IMPL_KWARGS[optimizer_impl(t, device)])
    if t.optimizer == "radam":  # the SRU++ paper's
        return torch.optim.RAdam(groups, decoupled_weight_decay=True, **common)
    if t.optimizer == "adamw":  # GPT recipes' (nanoGPT)
        return torch.optim.AdamW(groups, **common)
    raise ValueError(f"unknown optimizer {t.optimizer!r}")  # TrainConfig refuses it first


# The optimiser flags of each train.optimizer_impl ("default": torch's own choice)
IMPL_KWARGS = {"fused": {"fused": True}, "foreach": {"foreach": True},
               "loop": {"foreach": False}, "default": {}}
IMPL_FLAGS = ("fused", "foreach")  # the groups' keys that name the implementation


def optimizer_impl(t: TrainConfig, device) -> str:
    """The implementation ``train.optimizer_impl`` asks for on ``device``: fused, foreach,
    loop, or default (torch's own choice: the loop on the CPU).

    ``auto`` is fused on CUDA where torch has a fused kernel for the optimiser
    (AdamW: one kernel for every tensor, and with fp16 no wait for the loss
    scaler's check: GradScaler hands it to the kernel), foreach on CUDA
    otherwise (RAdam), and torch's default on the CPU.
    """
    if t.optimizer_impl != "auto":
        return t.optimizer_impl
    if torch.device(device).type != "cuda":
        return "default"
    return "fused" if has_fused(t.optimizer) else "foreach"


def _new_interval() -> Dict[str, float]:
    """The sums of one logging interval: the loss's sum and count, tokens read, seconds.

    The loss's sum becomes a float64 tensor on the device in training (read when
    logged or saved), and is saved as a float."""
    return {"loss_sum": 0.0, "count": 0, "tokens": 0, "seconds": 0.0}
