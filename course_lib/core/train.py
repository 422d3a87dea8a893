"""One training loop for every model of the course, in the spirit of minGPT's trainer. It knows no
model: `loss_fn(model, batch, step)` (step: optimizer steps so far) returns a scalar loss or a dict
with "loss" and other scalars to log. AdamW with LightningDOT's recipe (core.optimizer), gradient
accumulation and clipping, periodic evaluation, a `History`, and checkpoints that resume bit-for-bit
(the trainer owns the data order; CPU or CUDA, `num_workers=0`). A finished run's checkpoint makes
`fit()` return at once: how notebooks cache trained models. `amp=True` acts on CUDA only (bfloat16,
else float16 with a GradScaler). In a group of N processes batch_size is per process and the run
matches one process of batch N * batch_size; only rank 0 shows progress, evaluates and saves."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from course_lib.core import distributed
from course_lib.core.checkpoints import TRAINER_FORMAT, check_model_state, inference
from course_lib.core.files import training_lock, write_atomically
from course_lib.core.history import History
from course_lib.core.optimizer import param_groups, warmup_linear_decay
from course_lib.core.rng_state import capture_rng_state, restore_rng_state
from course_lib.core.settings import CourseNote, get_device, seed_everything
from course_lib.core.train_config import TrainConfig

# config fields that change a run's numbers: resuming with other values warns
_RESULT_FIELDS = ("batch_size", "lr", "lr_scales", "weight_decay", "betas", "eps",
                  "warmup_fraction", "grad_clip", "grad_accum_steps", "amp", "seed", "shuffle",
                  "drop_last")


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors inside (nested) dicts, lists and tuples to `device`; keep the rest."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def _scalar(value: Any) -> float | None:
    """A float from a number or one-element tensor; None for anything else (not logged)."""
    if torch.is_tensor(value):
        return float(value.detach()) if value.numel() == 1 else None
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return float(value)
    return None


def _checked_loss(out: Any) -> torch.Tensor:
    """The loss tensor of a loss_fn output, or a clear error saying what is wrong with it."""
    if isinstance(out, dict):
        if "loss" not in out:
            raise KeyError(f"loss_fn returned a dict without a 'loss' entry (keys: {list(out)})")
        out = out["loss"]
    if not torch.is_tensor(out) or out.numel() != 1:
        what = f"shape {tuple(out.shape)}" if torch.is_tensor(out) else type(out).__name__
        raise ValueError(f"loss_fn must return a scalar tensor, got {what}: reduce it with "
                         ".mean() or .sum(), and do not call .item() on it")
    if not out.requires_grad:
        raise ValueError("the loss does not require grad: was it computed under torch.no_grad()"
                         " or from detached tensors?")
    return out.reshape(())


class Trainer:
    """Minimise `loss_fn(model, batch, step)` over a map-style `dataset`. `evaluate(model) -> dict`
    runs every `eval_every` steps and at the end, in eval mode under torch.no_grad()."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], dataset,
                 config: TrainConfig | None = None, collate_fn: Callable | None = None,
                 evaluate: Callable[[nn.Module], dict] | None = None):
        self.config = cfg = config or TrainConfig()
        self.rank, self.world_size = distributed.get_rank(), distributed.get_world_size()
        n = len(dataset)
        if n == 0:
            raise ValueError("the training dataset is empty")
        if self.world_size > 1 and not cfg.drop_last:
            raise ValueError("training on several processes needs drop_last=True: every process "
                             "must get a full batch_size share of each global batch")
        if cfg.drop_last and n < cfg.batch_size * self.world_size:
            raise ValueError(f"{n} samples make no batch of batch_size={cfg.batch_size} x "
                             f"{self.world_size} processes: lower it, or set drop_last=False")
        if cfg.keep_best is not None and evaluate is None:
            raise ValueError(f"keep_best={cfg.keep_best!r} keeps the best evaluation's weights, but"
                             " no evaluate was given: pass evaluate= (and eval_every) or None")
        self.dataset, self.loss_fn, self.collate_fn = dataset, loss_fn, collate_fn
        self.evaluate = evaluate
        self.device = torch.device(cfg.device) if cfg.device else get_device()
        self.model = model.to(self.device)
        self._ddp = distributed.data_parallel_loss(self.model)  # (loss_fn, batch, step) or None
        self.use_amp = cfg.amp and self.device.type == "cuda"
        self.amp_dtype = (torch.bfloat16 if self.use_amp and torch.cuda.is_bf16_supported()
                          else torch.float16)
        self._build_optimizer()
        self._reset_progress()

    def _build_optimizer(self) -> None:
        cfg = self.config
        groups = param_groups(self.model, cfg.weight_decay, cfg.lr, cfg.lr_scales)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
        warmup = round(cfg.warmup_fraction * cfg.max_steps)
        # LambdaLR's step counter = optimizer steps taken, so step 0 runs at lr 0 (as in HF).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: warmup_linear_decay(s, cfg.max_steps, warmup))
        # bfloat16 has float32's range, so only float16 needs loss scaling.
        self.scaler = torch.amp.GradScaler(
            "cuda", enabled=self.use_amp and self.amp_dtype == torch.float16)

    def _reset_progress(self) -> None:
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0  # micro-batches used in this epoch
        self.cpu_seconds = 0.0  # process CPU time inside training steps (all threads)
        self.history = History()
        self._window: dict = {"n": 0, "sums": {}, "counts": {}, "lr": 0.0}  # steps not yet logged
        self.best: dict | None = None  # keep_best: {"step", "value", "model": CPU weights copy}

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        """Rank r's slice (the r-th batch_size rows) of each global batch, so the gathered batch is
        one process's (DistributedSampler's r, r + N, ... would permute it)."""
        cfg, n, size = self.config, len(self.dataset), self.config.batch_size * self.world_size
        gen = torch.Generator().manual_seed(self._epoch_seed(epoch))
        order = torch.randperm(n, generator=gen).tolist() if cfg.shuffle else list(range(n))
        count = n // size if cfg.drop_last else math.ceil(n / size)
        shard = slice(self.rank * cfg.batch_size, (self.rank + 1) * cfg.batch_size)
        return [order[i * size:(i + 1) * size][shard] for i in range(count)]

    def _epoch_seed(self, epoch: int) -> int:
        return (self.config.seed * 1_000_003 + epoch) % (2**63)

    def _micro_batches(self):
        """Endless batches from (epoch, batch_in_epoch), not loading the skipped ones."""
        while True:
            batches = self._epoch_batches(self.epoch)
            # own generator: a DataLoader's seed from the global RNG would shift dropout on resume
            gen = torch.Generator().manual_seed(self._epoch_seed(self.epoch))
            loader = DataLoader(self.dataset, batch_sampler=batches[self.batch_in_epoch:],
                                collate_fn=self.collate_fn, num_workers=self.config.num_workers,
                                pin_memory=self.device.type == "cuda", generator=gen)
            for batch in loader:
                self.batch_in_epoch += 1
                if self.batch_in_epoch == len(batches):
                    self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                yield move_to_device(batch, self.device)

    def fit(self, resume: bool = True, stop_after: int | None = None) -> History:
        """Train to `config.max_steps`. resume=False starts afresh from the current weights,
        overwriting the checkpoint. stop_after: save and stop after this many steps of this call."""
        # one process trains into a checkpoint at a time (rank 0 holds the lock for its group)
        with training_lock(self.config.checkpoint_path if self.rank == 0 else None):
            distributed.barrier()
            return self._fit(resume, stop_after)

    def _fit(self, resume: bool, stop_after: int | None) -> History:
        cfg, path = self.config, self.config.checkpoint_path
        if resume and path and os.path.exists(path):
            self.load_checkpoint(path)
            done = self.step >= cfg.max_steps
            if self.rank == 0:
                tqdm.write(f"{'Loaded finished run' if done else 'Resumed'} from {path} at step "
                           f"{self.step}/{cfg.max_steps}{' (no training needed)' if done else ''}")
            if done:
                return self.history
        elif self.step == 0 or not resume:  # fresh start; else continue the run held in memory
            if self.step > 0:
                self._build_optimizer()
            self._reset_progress()
            seed_everything(cfg.seed + self.rank)  # other processes: their own dropout masks
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        end = cfg.max_steps if stop_after is None else min(cfg.max_steps, self.step + stop_after)
        batches = self._micro_batches()
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train",
                   disable=not cfg.progress or self.rank != 0)
        try:
            while self.step < end:
                started = time.process_time()
                self._train_step(batches)
                self.cpu_seconds += time.process_time() - started
                bar.update(1)
                last = self.step == cfg.max_steps
                if self.step % cfg.log_every == 0 or last:
                    row = self._log_row()
                    bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
                evaluates = self.evaluate and self.rank == 0  # the others wait at the all-reduce
                if evaluates and ((cfg.eval_every and self.step % cfg.eval_every == 0) or last):
                    self._run_evaluate()
                due = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                if path and due and self.step < end:  # the last one is saved below
                    self.save_checkpoint(path)
        finally:
            bar.close()
            batches.close()  # shuts down DataLoader workers now, not at garbage collection
        if self.step == cfg.max_steps and self.best is not None:  # keep_best: its weights win
            self.model.load_state_dict(self.best["model"])
            self.history.append({"step": self.step, "kept_step": self.best["step"],
                                 f"kept_{cfg.keep_best}": self.best["value"]})
            self.best = None  # the model holds them now: a finished checkpoint needs no second copy
        if path:
            self.save_checkpoint(path)
            distributed.barrier()  # no process reads the checkpoint before rank 0 has written it
        return self.history

    def _train_step(self, batches) -> None:
        cfg, sums = self.config, {}
        autocast = (torch.autocast("cuda", dtype=self.amp_dtype) if self.use_amp
                    else contextlib.nullcontext())
        for micro in range(cfg.grad_accum_steps):
            batch = next(batches)
            last = micro == cfg.grad_accum_steps - 1  # DDP all-reduces in the last backward only
            with self._ddp.no_sync() if self._ddp and not last else contextlib.nullcontext():
                with autocast:
                    out = (self._ddp(self.loss_fn, batch, self.step) if self._ddp
                           else self.loss_fn(self.model, batch, self.step))
                loss = _checked_loss(out)
                self.scaler.scale(loss / cfg.grad_accum_steps).backward()
            for k, v in (out.items() if isinstance(out, dict) else [("loss", loss)]):
                # on the device until the step ends: no host sync per micro-batch
                scalar_tensor = torch.is_tensor(v) and v.numel() == 1
                v = v.detach().float().sum() if scalar_tensor else _scalar(v)
                if v is not None:
                    sums[k] = sums.get(k, 0.0) + v
        values = distributed.mean_over_ranks(  # every process sees a NaN and stops
            {k: float(v) / cfg.grad_accum_steps for k, v in sums.items()}, self.device)
        if not math.isfinite(values["loss"]):
            raise FloatingPointError(
                f"loss is {values['loss']} at step {self.step + 1} (epoch {self.epoch}): lower "
                f"the learning rate (lr={cfg.lr}), keep grad_clip on, and check the inputs for "
                "NaN/inf or a log/division of zero in loss_fn")
        if cfg.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
            norm = nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            values["grad_norm"] = float(norm)  # before clipping: shows how often clipping bites
        lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        w = self._window
        w["n"], w["lr"] = w["n"] + 1, lr
        for k, v in values.items():  # a key may come only on some steps (one task per batch)
            w["sums"][k], w["counts"][k] = w["sums"].get(k, 0.0) + v, w["counts"].get(k, 0) + 1

    def _log_row(self) -> dict:
        w = self._window
        row = {"step": self.step, "epoch": self.epoch, "lr": w["lr"]}
        row.update({k: v / w.get("counts", {}).get(k, w["n"]) for k, v in w["sums"].items()})
        self.history.append(row)
        self._window = {"n": 0, "sums": {}, "counts": {}, "lr": 0.0}
        return row

    def _run_evaluate(self) -> None:
        with inference(self.model):  # eval mode, no grad; back to train mode after
            metrics = self.evaluate(self.model)
        if not isinstance(metrics, dict):
            raise TypeError(f"evaluate must return a dict of metrics, got {type(metrics).__name__}")
        row = {"step": self.step, "eval": True, "cpu_seconds": round(self.cpu_seconds, 2)}
        row.update({k: _scalar(v) for k, v in metrics.items() if _scalar(v) is not None})
        self.history.append(row)
        key = self.config.keep_best
        if key is not None:
            if row.get(key) is None:
                raise KeyError(f"keep_best={key!r} is not a metric of evaluate (it returned "
                               f"{sorted(metrics)})")
            if self.best is None or row[key] > self.best["value"]:  # the first of equals is kept
                weights = {k: v.detach().to("cpu", copy=True)
                           for k, v in self.model.state_dict().items()}
                self.best = {"step": self.step, "value": row[key], "model": weights}

    def state_dict(self) -> dict:
        """All a resume needs: weights, optimizer, schedule, data position, history, RNGs."""
        config = dataclasses.asdict(self.config) | {"betas": tuple(self.config.betas)}
        return {"format": TRAINER_FORMAT, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "step": self.step, "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch, "cpu_seconds": self.cpu_seconds,
                "history": list(self.history), "best": self.best,
                "window": self._window, "rng": capture_rng_state(), "config": config}

    def save_checkpoint(self, path: str | None = None) -> None:
        """Write the trainer state atomically, on rank 0 only (other ranks resume inexactly)."""
        path = path or self.config.checkpoint_path
        if not path:
            raise ValueError("no path given and config.checkpoint_path is None")
        if self.rank == 0:
            write_atomically(path, lambda temporary: torch.save(self.state_dict(), temporary))

    def load_checkpoint(self, path: str) -> None:
        """Restore the state `save_checkpoint` wrote (then `fit()` continues)."""
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(ckpt, dict) or ckpt.get("format") != TRAINER_FORMAT:
            raise ValueError(f"{path!r} is not a Trainer checkpoint (use load_model_weights)")
        check_model_state(self.model, ckpt["model"], f"checkpoint {path!r}")
        changed = [k for k in _RESULT_FIELDS if ckpt["config"].get(k) != getattr(self.config, k)
                   and not (k == "betas" and tuple(ckpt["config"][k]) == tuple(self.config.betas))]
        if changed:
            warnings.warn(f"resuming {path!r} with a config that differs in {changed}: the run "
                          "will not match an uninterrupted one", CourseNote, stacklevel=3)
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if self.scaler.is_enabled() and ckpt["scaler"]:
            self.scaler.load_state_dict(ckpt["scaler"])
        self.step, self.epoch = ckpt["step"], ckpt["epoch"]
        self.batch_in_epoch = ckpt["batch_in_epoch"]
        self.cpu_seconds = ckpt.get("cpu_seconds", 0.0)  # absent in older checkpoints
        self.history, self._window = History(ckpt["history"]), ckpt["window"]
        self.best = ckpt.get("best")  # keep_best's best evaluation so far (absent in older ones)
        restore_rng_state(ckpt["rng"])  # last, so nothing above consumes random numbers after it
