"""Search over embedded galleries: an exact FAISS index, its brute-force reference, storage sizes.

A dual encoder turns retrieval into maximum inner-product search: the gallery is embedded once,
offline, and a query costs one text encoding plus a top-k over N dot products. FAISS does that
top-k on the CPU without building the (Q, N) score matrix in Python:

    index = build_index(image_emb)                  # (N, E), "flat" = exact IndexFlatIP
    scores, indices = search(index, text_emb, k=10)  # (Q, k) numpy, best first
    brute_force_topk(image_emb, text_emb, k=10)      # the same with torch: the reference

For L2-normalised embeddings (VSE++) inner product is cosine similarity; LightningDOT compares raw
dot products, which the same index serves. `INDEX_KINDS` maps a name to a builder, so approximate
indexes (IVF, HNSW) slot in beside "flat" without changing `build_index` / `search`.
`embedding_bytes` measures what an index stores: one vector per item instead of a set of region
features (LightningDOT §1: 768 floats per image vs 36 x 2048 region features).
"""

from __future__ import annotations

from typing import Callable

import faiss
import numpy as np
import torch


def _flat_ip(dim: int) -> faiss.Index:
    return faiss.IndexFlatIP(dim)  # exact: scores every stored vector


# name -> builder(dim) returning an empty index; an index that needs training (IVF) is trained on
# the gallery by build_index before the vectors are added
INDEX_KINDS: dict[str, Callable[[int], faiss.Index]] = {"flat": _flat_ip}


def as_float32_matrix(x, name: str = "embeddings") -> np.ndarray:
    """x (torch tensor on any device, or array-like) as a C-contiguous float32 (n, E) numpy array.

    FAISS reads only contiguous float32 rows on the CPU; a 1-D x is taken as a single row.
    """
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[None, :]  # one vector -> (1, E)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (n, dim) matrix, got shape {x.shape}; "
                         "stack one embedding per row")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise TypeError(f"{name} must hold numbers, got dtype {x.dtype}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).any(axis=1).sum())
        raise ValueError(f"{name} holds NaN or inf in {bad} of {len(x)} rows; an encoder that "
                         "diverged or a division by a zero norm produces these")
    return x


def build_index(embeddings, kind: str = "flat") -> faiss.Index:
    """A FAISS index over the rows of embeddings (N, E), searched by inner product.

    kind "flat" is exact (`faiss.IndexFlatIP`): the reference every approximate index is measured
    against. The vectors are copied (float32, CPU), so later changes to `embeddings` do not leak in.
    """
    if kind not in INDEX_KINDS:
        raise ValueError(f"unknown index kind {kind!r}; valid kinds: {sorted(INDEX_KINDS)}")
    x = as_float32_matrix(embeddings, "embeddings")  # (N, E)
    if len(x) == 0:
        raise ValueError("cannot index an empty gallery (0 embeddings)")
    index = INDEX_KINDS[kind](x.shape[1])
    if not index.is_trained:  # e.g. IVF learns its coarse centroids from the gallery itself
        index.train(x)
    index.add(x)
    return index


def search(index: faiss.Index, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k gallery items per query: (scores (Q, k) float32, indices (Q, k) int64), best first.

    queries: (Q, E) or one (E,) vector (-> Q = 1). k is capped at the index size, so k = 10 on a
    5-item gallery returns 5 columns rather than FAISS's padding of -1 indices.
    """
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if index.ntotal == 0:
        raise ValueError("the index is empty: add the gallery first (build_index does)")
    q = as_float32_matrix(queries, "queries")  # (Q, E)
    if q.shape[1] != index.d:
        raise ValueError(f"queries have dimension {q.shape[1]} but the index holds {index.d}-d "
                         "vectors; encode them with the same model (and projection)")
    scores, indices = index.search(q, min(int(k), index.ntotal))  # (Q, k), (Q, k)
    return scores, indices


def brute_force_topk(gallery: torch.Tensor, queries: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top-k by inner product with torch on the tensors' own device (the reference).

    gallery (N, E), queries (Q, E) or (E,); returns (scores (Q, k), indices (Q, k)) with k capped
    at N, best first. Builds the whole (Q, N) score matrix: fine for teaching-sized galleries.
    """
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    gallery, queries = torch.as_tensor(gallery), torch.as_tensor(queries)
    queries = queries.unsqueeze(0) if queries.dim() == 1 else queries  # (Q, E)
    if gallery.dim() != 2 or queries.dim() != 2 or gallery.shape[1] != queries.shape[1]:
        raise ValueError(f"need gallery (N, E) and queries (Q, E) of the same E, got "
                         f"{tuple(gallery.shape)} and {tuple(queries.shape)}")
    if len(gallery) == 0:
        raise ValueError("cannot search an empty gallery (0 embeddings)")
    scores = queries.float() @ gallery.float().T  # (Q, N)
    return torch.topk(scores, min(int(k), len(gallery)), dim=1)  # sorted, largest first


def embedding_bytes(n_items: int, dim: int, dtype=np.float32) -> int:
    """Bytes to store n_items vectors of dim numbers of dtype (numpy or torch dtype).

    embedding_bytes(1, 768) = 3,072 (one LightningDOT image vector) vs embedding_bytes(36, 2048)
    = 294,912 (its 36 region features): 96 x smaller, before any compression.
    """
    if n_items < 0 or dim < 0:
        raise ValueError(f"n_items and dim must be >= 0, got {n_items} and {dim}")
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else np.dtype(dtype).itemsize
    return int(n_items) * int(dim) * itemsize


__all__ = ["INDEX_KINDS", "as_float32_matrix", "build_index", "search", "brute_force_topk",
           "embedding_bytes"]
