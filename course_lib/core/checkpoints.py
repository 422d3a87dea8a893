"""Cached checkpoints of trained methods: one naming rule, so a cache folder never hands back a
model trained on other data, with another config or format; one way to find where a model lives."""

from __future__ import annotations

import hashlib
import json
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

# the arrays of a RetrievalSplit that a model may train on
CHECKPOINTS = "outputs/checkpoints"  # trained models of the benchmark, shared with the notebooks
DATA_ARRAYS = ("images", "regions", "boxes", "region_mask", "region_classes")
# arrays up to this size are checksummed whole; larger ones (real detector features) row-sampled
FULL_CHECKSUM_BYTES = 1 << 30


def _array_checksum(array: np.ndarray) -> str:
    """"<dtype> <shape> <crc32>" of every byte of the array; above FULL_CHECKSUM_BYTES, of evenly
    spaced rows (first and last included) that add up to about that much."""
    head = f"{array.dtype.str} {list(array.shape)}"
    if array.nbytes > FULL_CHECKSUM_BYTES and len(array) > 1:
        rows = max(2, int(FULL_CHECKSUM_BYTES // (array.nbytes // len(array))))
        array = array[np.unique(np.linspace(0, len(array) - 1, rows).astype(np.int64))]
    array = np.ascontiguousarray(array)  # no copy when it already is
    return f"{head} {zlib.crc32(array.reshape(-1).view(np.uint8)):08x}"


def data_digest(split) -> dict:
    """What a model trains on, beyond the vocabulary: the captions and which image each describes,
    a crc32 of every array (pixels, region features, boxes, masks, detector classes) and the image
    file list of real data. crc32 runs at several GB/s (docs/tuning_notes.md, "Core and data");
    `region_noise` or `clutter` change it as they change the data."""
    captions = hashlib.sha1("\n".join(split.captions).encode()).hexdigest()
    digest = {"n_images": split.n_images, "captions": captions,
              "txt2img": f"{zlib.crc32(np.ascontiguousarray(split.txt2img, dtype=np.int64)):08x}"}
    for name in DATA_ARRAYS:
        value = getattr(split, name, None)
        digest[name] = None if value is None else _array_checksum(np.asarray(value))
    paths = getattr(split, "image_paths", None)
    digest["image_paths"] = (None if paths is None
                             else hashlib.sha1("\n".join(map(str, paths)).encode()).hexdigest())
    return digest


def checkpoint_fingerprint(config: dict, train_split, tokenizer, *extra, version: int = 1) -> dict:
    """What a trained model is trained from: the config (a dict), the training data (data_digest:
    its captions, pairs, pixels, regions, boxes, masks and image paths), the tokenizer's vocabulary,
    anything in `extra` (e.g. another stage's checkpoint name) and the format version its method
    declares (bumped when the parameter layout or the training recipe changes on purpose). Not the
    source code: an edit that changes no number keeps every model (the shipped models' output
    fingerprints, course_lib.shipping, check that it changed none)."""
    return {"format": MODEL_FORMAT, "version": version, "config": config,
            "vocab": sorted(tokenizer.get_vocab().items()), "data": data_digest(train_split),
            "extra": list(extra)}


def fingerprint_hash(value) -> str:
    """sha1 hex digest of a JSON value (keys sorted; anything else by its str)."""
    return hashlib.sha1(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint_file_name(prefix: str, fingerprint: dict) -> str:
    """"<prefix>-<hash>.pt": the file name of the model a checkpoint_fingerprint describes."""
    return f"{prefix}-{fingerprint_hash(fingerprint)[:10]}.pt"


def checkpoint_name(prefix: str, config: dict, train_split, tokenizer, *extra,
                    version: int = 1) -> str:
    """"<prefix>-<hash>.pt" of checkpoint_fingerprint(config, train_split, tokenizer, *extra,
    version=version): a cache folder never hands back a model trained on other data or with
    another config, format or starting point."""
    return fingerprint_file_name(prefix, checkpoint_fingerprint(config, train_split, tokenizer,
                                                                *extra, version=version))


# Bump when every model's modules change shape or names (e.g. encoders moved onto core.blocks), so
# an old cache never hands a checkpoint to a model that cannot load it; one method's own changes
# bump its Method.format_version instead.
MODEL_FORMAT = 2


def model_device(model: nn.Module, device=None) -> torch.device:
    """`device` if given, else the device of the model's first parameter."""
    return torch.device(device) if device is not None else next(model.parameters()).device


@contextmanager
def inference(model: nn.Module, device=None):
    """The one way the course runs a model to encode or score: on `device` (None = where it is),
    in eval mode, without gradients; the model's train/eval mode is restored afterwards.

        with inference(model) as device:
            out = model.encode_images(batch.to(device))"""
    device = model_device(model, device)
    was_training = model.training
    model.to(device).eval()
    try:
        with torch.no_grad():
            yield device
    finally:
        model.train(was_training)


def finished_checkpoint(checkpoint_path, max_steps: int) -> bool:
    """True when checkpoint_path holds a course_lib.core.train run that reached max_steps."""
    if checkpoint_path is None or not Path(checkpoint_path).exists():
        return False
    return torch.load(checkpoint_path, map_location="cpu", weights_only=True)["step"] >= max_steps


# the format tag of a Trainer checkpoint (a tag, not a module path: keep it)
TRAINER_FORMAT = "course_lib.train/1"
# a shipped model: float16 weights and training history only (core/shipped.py)
SHIPPED_FORMAT = "course_lib.shipped/2"


def check_model_state(model: nn.Module, state: dict, source: str) -> None:
    """Raise a readable error when a state dict comes from a different model (not torch's wall)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k}: {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in state and hasattr(state[k], "shape") and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = [f"{what} ({len(keys)}): {keys[:5]}" for what, keys in
                 (("missing keys", missing), ("unexpected keys", unexpected),
                  ("shape mismatches", shapes)) if keys]
        raise ValueError(f"{source} was saved from a different model: " + "; ".join(parts)
                         + ". Use another checkpoint_path, delete the file, or fit(resume=False).")


def load_model_weights(model: nn.Module, checkpoint_path: str) -> nn.Module:
    """Load the model weights of a Trainer checkpoint, a shipped model or a plain state dict file
    into `model`."""
    ckpt = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    wrapped = isinstance(ckpt, dict) and ckpt.get("format") in (TRAINER_FORMAT, SHIPPED_FORMAT)
    state = ckpt["model"] if wrapped else ckpt
    check_model_state(model, state, f"checkpoint {checkpoint_path!r}")
    model.load_state_dict(state)
    return model
