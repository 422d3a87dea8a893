"""Trained models on disk: where the benchmark caches them, how a checkpoint's weights load into a
model, and the one way a model runs to encode or score. Their names come from core.stages."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

CHECKPOINTS = "outputs/checkpoints"  # trained models of the benchmark, shared with the notebooks


def model_device(model: nn.Module, device=None) -> torch.device:
    """`device` if given, else the device of the model's first parameter."""
    return torch.device(device) if device is not None else next(model.parameters()).device


@contextmanager
def inference(model: nn.Module, device=None):
    """Run a model on `device` (None = where it is) in eval mode without gradients, restoring its
    mode after: `with inference(model) as device: model.encode_images(batch.to(device))`."""
    device = model_device(model, device)
    was_training = model.training
    model.to(device).eval()
    try:
        with torch.no_grad():
            yield device
    finally:
        model.train(was_training)


def finished_checkpoint(checkpoint_path, max_steps: int) -> bool:
    """True when checkpoint_path holds a Trainer run that reached max_steps."""
    if checkpoint_path is None or not Path(checkpoint_path).exists():
        return False
    return torch.load(checkpoint_path, map_location="cpu", weights_only=True)["step"] >= max_steps


TRAINER_FORMAT = "course_lib.train/1"  # a format tag, not a module path: keep it
SHIPPED_FORMAT = "course_lib.shipped/2"  # float16 weights and training history (core/shipped.py)


def check_model_state(model: nn.Module, state: dict, source: str) -> None:
    """A readable error when a state dict comes from a different model (not torch's wall)."""
    own = model.state_dict()
    problems = {"missing keys": [k for k in own if k not in state],
                "unexpected keys": [k for k in state if k not in own],
                "shape mismatches": [f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}"
                                     for k, v in own.items() if k in state
                                     and hasattr(state[k], "shape") and state[k].shape != v.shape]}
    parts = [f"{what} ({len(keys)}): {keys[:5]}" for what, keys in problems.items() if keys]
    if parts:
        raise ValueError(f"{source} was saved from a different model: " + "; ".join(parts)
                         + ". Use another checkpoint_path, delete the file, or fit(resume=False).")


def load_model_weights(model: nn.Module, checkpoint_path: str) -> nn.Module:
    """Load a Trainer checkpoint's, a shipped model's or a plain state dict's weights into model."""
    ckpt = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    wrapped = isinstance(ckpt, dict) and ckpt.get("format") in (TRAINER_FORMAT, SHIPPED_FORMAT)
    state = ckpt["model"] if wrapped else ckpt
    check_model_state(model, state, f"checkpoint {checkpoint_path!r}")
    model.load_state_dict(state)
    return model
