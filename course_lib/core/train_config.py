"""The knobs of the one training loop (core.train.Trainer), built from a method config's own
training fields by `train_config`, so a knob means the same thing in every method."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    max_steps: int = 1000  # optimizer steps (a step = grad_accum_steps micro-batches)
    batch_size: int = 32  # samples per micro-batch (of each process, when distributed)
    lr: float = 1e-4  # peak learning rate, reached at the end of warm-up
    # parameter-name prefix -> multiplier of lr (e.g. {"text_encoder.": 0.1} for a pretrained part);
    # None = one rate for every parameter (core.optimizer.param_groups)
    lr_scales: dict | None = None
    weight_decay: float = 0.01  # AdamW decoupled decay, on 2-D+ tensors only
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW betas (LightningDOT / UNITER)
    eps: float = 1e-6  # AdamW epsilon (BERT / UNITER value)
    warmup_fraction: float = 0.1  # share of max_steps spent warming up linearly from 0
    grad_clip: float | None = 2.0  # max global gradient norm; None = no clipping (VSE++ uses 2.0)
    grad_accum_steps: int = 1  # micro-batches per optimizer step (loss divided accordingly)
    amp: bool = False  # mixed precision on CUDA only; ignored on CPU / MPS
    eval_every: int | None = None  # call evaluate every this many steps; None = only at the end
    log_every: int = 10  # steps averaged into one history row
    checkpoint_path: str | None = None  # where to save / resume; None = no checkpoints
    checkpoint_every: int | None = None  # steps between saves; None = only at the end or stop
    seed: int = 0  # seeds python/numpy/torch on a fresh start, and the data order
    num_workers: int = 0  # DataLoader worker processes (0 = exact resume, see module docstring)
    shuffle: bool = True  # reshuffle every epoch (from seed and epoch)
    drop_last: bool = True  # drop the last incomplete batch of each epoch
    progress: bool = True  # show a tqdm progress bar
    device: str | None = None  # e.g. "cpu", "cuda"; None = settings.get_device()
    # an evaluate metric (e.g. "val_t2i_r1"): the run ends with the weights of its best evaluation
    # (early stopping on val, higher is better); None = the last step's weights
    keep_best: str | None = None


# the training knobs a method config declares (its own defaults and reasons) and hands TrainConfig
TRAIN_FIELDS = ("max_steps", "batch_size", "lr", "warmup_fraction", "grad_clip", "seed",
                "keep_best")
CHECKPOINT_EVERY_AT_LEAST = 50  # steps between train_config's periodic saves, at the fewest


def train_config(config, **runtime) -> TrainConfig:
    """TrainConfig from whichever TRAIN_FIELDS `config` has, with `runtime` on top."""
    shared = {f: getattr(config, f) for f in TRAIN_FIELDS if hasattr(config, f)}
    if runtime.get("checkpoint_path") is not None:
        runtime["checkpoint_path"] = str(runtime["checkpoint_path"])
        # saved every tenth of the run: an interrupted run resumes there, not from step 0
        steps = {**shared, **runtime}.get("max_steps", TrainConfig.max_steps)
        runtime.setdefault("checkpoint_every", max(CHECKPOINT_EVERY_AT_LEAST, steps // 10))
    return TrainConfig(**{**shared, **runtime})
