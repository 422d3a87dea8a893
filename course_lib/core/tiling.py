"""Galleries for timing: grow real embeddings (or any rows) to sizes we have no data for.

    tile_rows(image_emb, 1_000_000, noise=0.1)  # (N0, E) -> (1M, E): originals, noisy copies"""

from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from course_lib.core.retrieval import as_float32_matrix

_TILE_CHUNK = 1 << 16  # synthetic gallery rows generated at a time (memory)


def tile_rows(rows, n: int, *, noise: float = 0.0, construction: str = "tiled", seed: int = 0,
              progress: bool = False):
    """A gallery of n rows: the N0 `rows` first, then synthetic ones. noise = 0, "tiled": row i is
    rows[i mod N0] (any shape and dtype). noise > 0, "tiled": copies moved by noise * std * N(0, 1)
    (no exact ties); "gaussian": drawn from N(mean, cov) of rows; these give float32 (n, E)."""
    if construction not in ("tiled", "gaussian"):
        raise ValueError(f"construction must be 'tiled' or 'gaussian', got {construction!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 or not noise >= 0:
        raise ValueError(f"need a gallery size n >= 1 and noise >= 0, got {n!r} and {noise!r}")
    if isinstance(rows, torch.Tensor):
        if len(rows) == 0:
            raise ValueError("cannot tile an empty tensor")
        if noise == 0 and construction == "tiled":  # (n, ...) plain copies, any shape and dtype
            return rows.repeat(-(-n // len(rows)), *[1] * (rows.dim() - 1))[:n]
        return torch.from_numpy(tile_rows(as_float32_matrix(rows, "rows"), n, noise=noise,
                                          construction=construction, seed=seed, progress=progress))
    base = as_float32_matrix(rows, "rows")  # (N0, E)
    gallery = np.empty((n, base.shape[1]), dtype=np.float32)  # (n, E)
    head = min(n, len(base))
    gallery[:head] = base[:head]
    rng = np.random.default_rng(seed)
    scale, mean = noise * base.std(axis=0), base.mean(axis=0)  # (E,) each
    if construction == "gaussian":  # x = mean + L eps with L L^T = cov (+ a ridge for safety)
        cov = np.cov(base, rowvar=False) + 1e-6 * np.eye(base.shape[1])  # (E, E)
        chol = np.linalg.cholesky(cov).astype(np.float32)
    for start in tqdm(range(head, n, _TILE_CHUNK), desc=f"gallery {n:,}", disable=not progress,
                      leave=False):
        stop = min(n, start + _TILE_CHUNK)
        eps = rng.standard_normal((stop - start, base.shape[1]), dtype=np.float32)  # (c, E)
        if construction == "tiled":
            gallery[start:stop] = base[np.arange(start, stop) % len(base)] + eps * scale
        else:
            gallery[start:stop] = mean + eps @ chol.T
    return gallery
