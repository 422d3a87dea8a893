"""The random number generators' states (Python, NumPy, torch, CUDA) as plain values: saved in a
Trainer checkpoint, so an interrupted run resumes bit for bit, and loadable with
torch.load(weights_only=True)."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng_state() -> dict:
    # numpy's state is stored as plain lists so the file loads with torch.load(weights_only=True).
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), int(pos), int(has_gauss),
            float(gauss)], "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


__all__ = ["capture_rng_state", "restore_rng_state"]
