"""The language-model trainer: one run directory, exact resume, progress and metrics.

The loop, in order: carry the state across segments (detached), accumulate
gradients over ``grad_accum`` segments, clip, step RAdam, step the schedule;
log every ``log_every`` steps, validate every ``eval_every``, checkpoint every
``save_every``. Everything a resumed run needs is in the checkpoint: weights,
optimiser, schedule (with its length), RNG, data position, the carried state
and the partial loss sums of the current log interval.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ..data import StreamBatcher, build_tokenizer, load_corpus, tokenizer_from_dict
from ..errors import UserError
from ..models import build_model
from .checkpoint import (load_carried_state, load_trainer_state, read_json, resolve_checkpoint,
                         save_checkpoint, write_json_atomic)
from .config import RunConfig
from .evaluate import autocast_context, evaluate


CALIBRATION_SKIP = 5  # untimed warm-up steps before the calibration window
# The first calibration sees only a few early steps, which can run slower or
# faster than the rest (caches, allocator, a neighbour's load); the schedule
# length is fitted once more, from every step since, at this fraction of the budget.
REFIT_AT = 0.25


def bf16_supported_on_cpu() -> bool:
    """Whether this CPU has native bf16 arithmetic (AVX-512 BF16 or AMX)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def check_tokenizer_fits(tokenizer, text: str, max_oov: float, where: str) -> float:
    rate = tokenizer.oov_rate(text)
    if rate > max_oov:
        raise UserError(
            f"the saved {tokenizer.to_dict()['type']} tokenizer does not fit {where}: "
            f"{rate:.1%} of it is out of vocabulary (data.max_oov={max_oov:.1%}); "
            f"use the data the run was trained on, or raise data.max_oov")
    return rate


class Trainer:
    """Train a language model (:func:`~srupp.models.build_model`, any ``model.type``) into ``run_dir``.

    Args:
        cfg: the run configuration.
        run_dir: where checkpoints, metrics and plots go.
        resume: continue from ``run_dir``'s last checkpoint.
        progress: show a tqdm progress bar on stderr.
    """

    def __init__(self, cfg: RunConfig, run_dir, *, resume: bool = False, progress: bool = True):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.progress = progress
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = torch.device(t.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UserError("train.device=cuda but no CUDA device is available; use train.device=cpu")
        self.precision = t.precision
        if self.precision == "fp16" and self.device.type != "cuda":
            raise UserError("train.precision=fp16 needs CUDA; on CPU use bf16 or fp32")
        if self.precision == "bf16" and self.device.type == "cpu" and not bf16_supported_on_cpu():
            warnings.warn("this CPU has no native bf16; training in fp32 instead", stacklevel=2)
            self.precision = "fp32"

        ckpt = None
        if resume:
            ckpt = resolve_checkpoint(self.run_dir, prefer="last")
        elif (self.run_dir / "last.json").exists():
            raise UserError(f"{self.run_dir} already holds a run; pass --resume to continue it "
                            f"or choose another --out")

        # ---- data and tokenizer
        self.corpus = load_corpus(cfg.data.corpus)
        if resume:
            self.tokenizer = tokenizer_from_dict(read_json(self.run_dir / "tokenizer.json",
                                                           "tokenizer"))
            check_tokenizer_fits(self.tokenizer, self.corpus.valid, cfg.data.max_oov,
                                 f"the validation split of {cfg.data.corpus}")
        else:
            self.tokenizer = build_tokenizer(cfg.data.tokenizer, self.corpus.train,
                                             **cfg.data.tokenizer_options())
        self.train_ids = self.tokenizer.encode(self.corpus.train)
        self.valid_ids = self.tokenizer.encode(self.corpus.valid)
        self.batcher = StreamBatcher(self.train_ids, t.batch_size, t.unroll)

        # ---- model, optimiser, schedule
        torch.manual_seed(t.seed)
        self.model_config = cfg.model_config(self.tokenizer.vocab_size)
        self.model = build_model(self.model_config, device=self.device)
        self.optimizer = torch.optim.RAdam(self._param_groups(), lr=t.lr,
                                           weight_decay=t.weight_decay,
                                           decoupled_weight_decay=True)
        self.total_steps = t.max_steps  # fixed by calibration when max_seconds is set
        self.calibrated = t.max_seconds is None
        self.refitted = t.max_seconds is None
        self.calibrated_at = (0, 0.0)  # (step, train_seconds) when first calibrated
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, t.warmup_steps, self.total_steps, t.min_lr_ratio))
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None

        self.step = 0
        self.train_seconds = 0.0
        self.carried = None
        self.best_bpc = float("inf")
        self.interval = {"loss_sum": 0.0, "tokens": 0, "seconds": 0.0}
        if ckpt is not None:
            self._restore(ckpt)
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.run_dir / "config.json", cfg.to_dict())
            write_json_atomic(self.run_dir / "tokenizer.json", self.tokenizer.to_dict())

    # ----------------------------------------------------------------- setup
    def _param_groups(self):
        if not self.cfg.train.no_decay_bias_norm:
            return [{"params": list(self.model.parameters())}]
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if p.dim() >= 2 and "weight_c" not in name else no_decay).append(p)
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    def _trainer_state(self) -> Dict[str, Any]:
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "calibrated": self.calibrated,
            "refitted": self.refitted,
            "calibrated_at": list(self.calibrated_at),
            "train_seconds": self.train_seconds,
            "best_bpc": self.best_bpc,
            "interval": dict(self.interval),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [],
            "data": self.batcher.state_dict(),
        }

    def _restore(self, ckpt: Path) -> None:
        from safetensors.torch import load_model

        state = load_trainer_state(ckpt)
        try:
            load_model(self.model, str(ckpt / "model.safetensors"), device=str(self.device))
        except Exception as e:
            raise UserError(f"{ckpt / 'model.safetensors'} is truncated or corrupt or does "
                            f"not fit the config ({str(e).splitlines()[0][:200]})") from None
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.batcher.load_state_dict(state["data"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise UserError(f"{ckpt / 'trainer.pt'} does not fit this run ({e})") from None
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = state["step"]
        self.total_steps = state["total_steps"]
        self.calibrated = state["calibrated"]
        self.refitted = state.get("refitted", True)  # checkpoints from before the re-fit
        self.calibrated_at = tuple(state.get("calibrated_at", (0, 0.0)))
        self.train_seconds = state["train_seconds"]
        self.best_bpc = state["best_bpc"]
        self.interval = dict(state["interval"])
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng"):
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        carried = load_carried_state(ckpt)
        self.carried = None if carried is None else carried.to(self.device)
        self._truncate_metrics(self.step)

    # --------------------------------------------------------------- logging
    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _truncate_metrics(self, step: int) -> None:
        """Drop lines an interrupted run wrote after its last checkpoint."""
        if not self.metrics_path.exists():
            return
        lines = [ln for ln in self.metrics_path.read_text().splitlines() if ln.strip()]
        kept = []
        for ln in lines:
            try:
                if json.loads(ln).get("step", 0) <= step:
                    kept.append(ln)
            except json.JSONDecodeError:
                pass  # a line cut by the kill
        tmp = self.metrics_path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        tmp.replace(self.metrics_path)

    def _log(self, record: Dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    # ------------------------------------------------------------------ loop
    def _warm_up_kernels(self) -> None:
        """Build compiled kernels before the clock starts (one-time compilation is not training)."""
        try:
            from ..ops import warm_up
        except ImportError:
            return
        warm_up(self.device)

    def _train_step(self, it) -> float:
        t = self.cfg.train
        model, loss_sum, tokens = self.model, 0.0, 0
        for _ in range(t.grad_accum):
            batch = next(it)
            if batch.epoch_start:
                self.carried = None  # the streams start again from their beginning
            x, y = batch.inputs.to(self.device), batch.targets.to(self.device)
            with autocast_context(self.precision, self.device.type):
                out = model(x, self.carried, targets=y)
            loss = out.loss / t.grad_accum if t.grad_accum > 1 else out.loss
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            self.carried = out.state.detach()
            loss_sum += out.loss.item() * y.numel()
            tokens += y.numel()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.interval["loss_sum"] += loss_sum
        self.interval["tokens"] += tokens
        return loss_sum / tokens

    def validate(self, max_batches: Optional[int] = None) -> Dict[str, float]:
        e = self.cfg.eval
        return evaluate(self.model, self.valid_ids, batch_size=e.batch_size,
                        unroll=e.unroll or self.cfg.train.unroll, mem_len=e.mem_len,
                        precision=self.precision, max_batches=max_batches)

    def _save(self, pointers=("last",), info=None) -> None:
        save_checkpoint(self.run_dir, self.step, self.model, self.carried, self._trainer_state(),
                        tokenizer=self.tokenizer.to_dict(), pointers=pointers, info=info)

    def _out_of_time(self) -> bool:
        m = self.cfg.train.max_seconds
        return m is not None and self.train_seconds >= m

    def _calibrate(self, step_seconds: list) -> None:
        """Fix the schedule length so the cosine ends when the time budget does."""
        t = self.cfg.train
        self._fit_schedule(sorted(step_seconds)[len(step_seconds) // 2])
        self.calibrated = True
        self.calibrated_at = (self.step, self.train_seconds)

    def _refit(self) -> None:
        """Fit the schedule length again from the mean step time since calibration."""
        step0, seconds0 = self.calibrated_at
        if self.step > step0:
            self._fit_schedule((self.train_seconds - seconds0) / (self.step - step0))
        self.refitted = True

    def _fit_schedule(self, per_step: float) -> None:
        t = self.cfg.train
        remaining = t.max_seconds - self.train_seconds
        fits = self.step + int(0.97 * remaining / max(per_step, 1e-9))
        self.total_steps = max(self.step + 1, min(t.max_steps, fits))

    def train(self) -> Dict[str, Any]:
        """Run to ``total_steps`` or the time budget; returns a summary. Ctrl-C saves and stops."""
        from tqdm import tqdm

        t = self.cfg.train
        self.model.train()
        self._warm_up_kernels()
        it = self.batcher.iter_from(self.batcher.position)
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not self.progress,
                   file=sys.stderr, dynamic_ncols=True, unit="step")
        calib_times: list = []
        last_postfix = 0.0
        interrupted = False
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            while self.step < self.total_steps and not self._out_of_time():
                start = time.perf_counter()
                loss = self._train_step(it)
                dt = time.perf_counter() - start
                self.train_seconds += dt
                self.interval["seconds"] += dt
                if not self.calibrated:
                    calib_times.append(dt)
                    # the first few steps run slower (allocator and caches warming up)
                    if len(calib_times) >= CALIBRATION_SKIP + t.calibration_steps:
                        self._calibrate(calib_times[CALIBRATION_SKIP:])
                        bar.total = self.total_steps
                elif (not self.refitted and self.train_seconds >= REFIT_AT * t.max_seconds
                      and self.step - self.calibrated_at[0] >= t.calibration_steps):
                    self._refit()
                    bar.total = self.total_steps
                bar.update(1)
                tok_s = self.interval["tokens"] / max(self.interval["seconds"], 1e-9)
                now = time.monotonic()
                if now - last_postfix > 0.5:  # formatting every step costs measurable time
                    last_postfix = now
                    left = (f"{max(0.0, t.max_seconds - self.train_seconds):.0f}s"
                            if t.max_seconds else "-")
                    bar.set_postfix(loss=f"{loss:.3f}", bpc=f"{loss / math.log(2):.3f}",
                                    tok_s=f"{tok_s:.0f}", left=left, refresh=False)
                if self.step % t.log_every == 0:
                    self._log({"step": self.step,
                               "train_loss": self.interval["loss_sum"] / self.interval["tokens"],
                               "lr": self.scheduler.get_last_lr()[0],
                               "tokens_per_s": tok_s, "train_seconds": self.train_seconds})
                    self.interval = {"loss_sum": 0.0, "tokens": 0, "seconds": 0.0}
                if self.step % t.eval_every == 0:
                    self._evaluate_and_save(t.eval_max_batches)
                elif self.step % t.save_every == 0:
                    self._save()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            signal.signal(signal.SIGTERM, previous)
            bar.close()
        if interrupted:
            self._save()
            print(f"interrupted: saved step {self.step} to {self.run_dir}; "
                  f"continue with --resume", file=sys.stderr)
            return {"interrupted": True, "step": self.step}
        final = self._evaluate_and_save(None)
        self.plot()
        return {"interrupted": False, "step": self.step, "valid_bpc": final["bpc"],
                "valid_ppl": final["ppl"],
                "train_seconds": self.train_seconds, "params": self.model.num_parameters()}

    def _evaluate_and_save(self, max_batches) -> Dict[str, float]:
        res = self.validate(max_batches)
        self._log({"step": self.step, "valid_bpc": res["bpc"], "valid_ppl": res["ppl"],
                   "valid_loss": res["loss"],
                   "valid_tokens": res["tokens"], "train_seconds": self.train_seconds})
        pointers = ["last"]
        if res["bpc"] < self.best_bpc:
            self.best_bpc = res["bpc"]
            pointers.append("best")
        self._save(tuple(pointers), info={"valid_bpc": res["bpc"]})
        return res

    def plot(self) -> Optional[Path]:
        """Write ``curves.png``: training and validation bpc against step."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            warnings.warn("matplotlib is not installed; curves.png not written", stacklevel=2)
            return None
        rows = [json.loads(ln) for ln in self.metrics_path.read_text().splitlines() if ln.strip()]
        train = [(r["step"], r["train_loss"] / math.log(2)) for r in rows if "train_loss" in r]
        valid = [(r["step"], r["valid_bpc"]) for r in rows if "valid_bpc" in r]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if train:
            ax.plot(*zip(*train), label="train", alpha=0.8)
        if valid:
            ax.plot(*zip(*valid), "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("bits per token")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out = self.run_dir / "curves.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
