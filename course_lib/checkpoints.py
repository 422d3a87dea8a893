"""Cached checkpoints of trained methods: one naming rule, so a cache folder never hands back a model
trained on other data or with another config, and one way to find where a model lives."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn


def checkpoint_name(prefix: str, config: dict, train_split, tokenizer, *extra) -> str:
    """"<prefix>-<hash>.pt": the hash covers the config (a dict), the training data (its captions,
    image count and feature shape), the tokenizer's vocabulary and anything in `extra`."""
    fingerprint = {
        "config": config,
        "vocab": sorted(tokenizer.get_vocab().items()),
        "n_images": train_split.n_images,
        "features": list(train_split.regions.shape[1:]) if train_split.has_regions else None,
        "captions": hashlib.sha1("\n".join(train_split.captions).encode()).hexdigest(),
        "extra": list(extra),
    }
    digest = hashlib.sha1(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()
    return f"{prefix}-{digest[:10]}.pt"


def model_device(model: nn.Module, device=None) -> torch.device:
    """`device` if given, else the device of the model's first parameter."""
    return torch.device(device) if device is not None else next(model.parameters()).device


def finished_checkpoint(checkpoint_path, max_steps: int) -> bool:
    """True when checkpoint_path holds a course_lib.train run that reached max_steps."""
    if checkpoint_path is None or not Path(checkpoint_path).exists():
        return False
    return torch.load(checkpoint_path, map_location="cpu", weights_only=True)["step"] >= max_steps
