"""Measuring an index against exact search: k-recall@k, one query's latency, the approximate
kinds' recall/latency trade-off, and what an index stores (course_lib.studies.index_scale runs
them on galleries of millions)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import faiss
import numpy as np
import torch

from course_lib.core.retrieval import as_float32_matrix, build_index, current_params, search
from course_lib.core.timing import measure


def topk_recall(found_ids, exact_ids) -> float:
    """k-recall@k in [0, 1] of found_ids (Q, k') against exact_ids (Q, k); -1 = nothing."""
    exact, found = np.asarray(exact_ids), np.asarray(found_ids)
    if exact.ndim != 2 or found.ndim != 2 or len(exact) != len(found):
        raise ValueError(f"need found (Q, k') and exact (Q, k) ids of the same Q queries, got "
                         f"shapes {found.shape} and {exact.shape}")
    hit = (exact[:, :, None] == found[:, None, :]).any(axis=2)  # (Q, k): exact hit returned?
    return float(hit.mean())


def recall_vs_exact(index: faiss.Index, exact_index: faiss.Index, queries, k: int) -> float:
    """k-recall@k against exact_index; matched by id, so a tie at the k-th place may miss."""
    if index.d != exact_index.d:
        raise ValueError(f"the indexes hold {index.d}-d and {exact_index.d}-d vectors; "
                         "build both over the same gallery")
    exact = search(exact_index, queries, k)[1]  # (Q, k)
    approx = search(index, queries, exact.shape[1])[1]  # (Q, <= k); -1 where FAISS found too few
    return topk_recall(approx, exact)


def time_single_queries(index: faiss.Index, queries: np.ndarray, k: int, *, warmup: int = 5,
                        repeats: int = 50):
    """timing.measure of one FAISS search at a time, cycling through queries (Q, E) float32."""
    singles = itertools.cycle([queries[i:i + 1] for i in range(len(queries))])  # (1, E) each
    k_eff = min(int(k), index.ntotal)
    return measure(lambda: index.search(next(singles), k_eff), warmup=warmup, repeats=repeats)


DEFAULT_TRADEOFF_CONFIGS: tuple[tuple[str, dict], ...] = (
    ("flat", {}),
    ("ivf", {"nprobe": 2}), ("ivf", {"nprobe": 8}), ("ivf", {"nprobe": 32}),
    ("hnsw", {"ef_search": 16}), ("hnsw", {"ef_search": 64}), ("hnsw", {"ef_search": 256}))


def _timed_build(gallery, kind: str, params: dict):
    """build_index(gallery, kind, **params) and the TimingResult of that one build."""
    built = {}  # measure keeps only the time: the index comes out through this
    timing = measure(lambda: built.update(index=build_index(gallery, kind, **params)),
                     warmup=0, repeats=1)
    return built["index"], timing


def index_tradeoff(gallery, queries, k: int = 10,
                   configs: Sequence[tuple[str, dict]] = DEFAULT_TRADEOFF_CONFIGS, *,
                   repeats: int = 50, warmup: int = 5) -> list[dict]:
    """Recall against exact search vs one query's latency, a row per (kind, params) of configs:
    {"kind", "params" (as built), "recall_at_k", "ms_per_query" (median), "build_s"}."""
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    exact = build_index(gallery, "flat")
    q = as_float32_matrix(queries, "queries")  # (Q, E)
    if len(q) == 0:
        raise ValueError("index_tradeoff needs at least one query (got 0 rows)")
    rows = []
    for config in configs:
        if not (isinstance(config, (tuple, list)) and len(config) == 2
                and isinstance(config[1], dict)):
            raise ValueError(f"each config must be a (kind, params dict) pair such as "
                             f"('ivf', {{'nprobe': 4}}), got {config!r}")
        kind, params = config
        index, build = _timed_build(gallery, kind, params)
        latency = time_single_queries(index, q, k, warmup=warmup, repeats=repeats)
        rows.append({"kind": kind, "params": current_params(index),
                     "recall_at_k": recall_vs_exact(index, exact, q, k),
                     "ms_per_query": latency.median_ms, "build_s": build.median_ms / 1e3})
    return rows


def embedding_bytes(n_items: int, dim: int, dtype=np.float32) -> int:
    """Bytes of n_items vectors of dim numbers of dtype (numpy or torch): LightningDOT §1's one
    768-d image vector (3,072) vs its 36 region features of 2048 (294,912), 96 x smaller."""
    if n_items < 0 or dim < 0:
        raise ValueError(f"n_items and dim must be >= 0, got {n_items} and {dim}")
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else np.dtype(dtype).itemsize
    return int(n_items) * int(dim) * itemsize
