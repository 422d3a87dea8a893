"""Search over embedded galleries: exact and approximate FAISS indexes, their brute-force
reference, the recall/latency trade-off of the approximate ones, storage sizes.

A dual encoder turns retrieval into maximum inner-product search: the gallery is embedded once,
offline, and a query costs one text encoding plus a top-k over N dot products. FAISS does that
top-k on the CPU without building the (Q, N) score matrix in Python:

    index = build_index(image_emb)                  # (N, E), "flat" = exact IndexFlatIP
    scores, indices = search(index, text_emb, k=10)  # (Q, k) numpy, best first
    brute_force_topk(image_emb, text_emb, k=10)      # the same with torch: the reference

For L2-normalised embeddings (VSE++) inner product is cosine similarity; LightningDOT compares raw
dot products, which the same index serves. `INDEX_KINDS` maps a name to a builder; besides the exact
"flat" there are two approximate kinds, both searched by inner product:

    build_index(x, "ivf", nlist=64, nprobe=8)   # k-means lists; a query scans its nprobe best
    build_index(x, "hnsw", M=32, ef_search=64)  # a graph walk keeping ef_search candidates
    set_search_params(index, nprobe=16)         # the search-time knob: more recall, more time
    recall_vs_exact(index, exact, queries, k)   # k-recall@k against the flat index
    index_tradeoff(gallery, queries)            # one row per setting: recall, ms per query, build s

`embedding_bytes` measures what an index stores: one vector per item instead of a set of region
features (LightningDOT §1: 768 floats per image vs 36 x 2048 region features).
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from typing import Callable, Sequence

import faiss
import numpy as np
import torch

from course_lib.timing import benchmark

# FAISS k-means warns below this many training points per centroid; IVF's nlist is capped by it
MIN_POINTS_PER_LIST = 39


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _flat_ip(dim: int, n: int) -> faiss.Index:
    return faiss.IndexFlatIP(dim)  # exact: scores every stored vector


def _ivf_flat(dim: int, n: int, *, nlist: int | None = None, nprobe: int = 8) -> faiss.Index:
    """IVF: k-means splits the gallery into nlist lists; a query scans only its nprobe best lists.

    nlist defaults to about 4 sqrt(n); any nlist is clamped to [1, n // 39] so that every list
    gets enough training points. nprobe is capped at nlist (nprobe = nlist scans everything).
    """
    cap = max(1, n // MIN_POINTS_PER_LIST)  # the most lists n vectors train well
    if nlist is None:
        nlist = min(cap, max(1, round(4 * math.sqrt(n))))
    elif _positive_int("nlist", nlist) > cap:
        warnings.warn(f"nlist={nlist} needs {nlist * MIN_POINTS_PER_LIST} training vectors "
                      f"({MIN_POINTS_PER_LIST} per list) but the gallery has {n}; using "
                      f"nlist={cap}. Pass nlist <= {cap}, or leave it unset for the default",
                      stacklevel=3)
        nlist = cap
    quantizer = faiss.IndexFlatIP(dim)  # holds the nlist centroids; the index keeps it alive
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.cp.min_points_per_centroid = 1  # we capped nlist ourselves; silence FAISS's n < 39 note
    index.nprobe = min(_positive_int("nprobe", nprobe), nlist)
    return index


def _hnsw_flat(dim: int, n: int, *, M: int = 32, ef_search: int = 64,
               ef_construction: int = 80) -> faiss.Index:
    """HNSW: a layered graph with M links per node (2M on the bottom layer), walked greedily.

    ef_construction candidates are kept while inserting (a better graph, a slower build),
    ef_search while searching (more recall, more time; keep it >= the k you search for).
    """
    index = faiss.IndexHNSWFlat(dim, _positive_int("M", M, minimum=2), faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = _positive_int("ef_construction", ef_construction)
    index.hnsw.efSearch = _positive_int("ef_search", ef_search)
    return index


# name -> builder(dim, n, **params) returning an empty index for a gallery of n vectors of dim;
# its keyword-only arguments are the parameters build_index accepts for that kind. An index that
# needs training (IVF) is trained on the gallery by build_index before the vectors are added.
INDEX_KINDS: dict[str, Callable[..., faiss.Index]] = {
    "flat": _flat_ip, "ivf": _ivf_flat, "hnsw": _hnsw_flat}


def index_params(kind: str) -> list[str]:
    """The parameters build_index accepts for an index kind, e.g. ["nlist", "nprobe"] for "ivf"."""
    if kind not in INDEX_KINDS:
        raise ValueError(f"unknown index kind {kind!r}; valid kinds: {sorted(INDEX_KINDS)}")
    params = inspect.signature(INDEX_KINDS[kind]).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


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


def build_index(embeddings, kind: str = "flat", **params) -> faiss.Index:
    """A FAISS index over the rows of embeddings (N, E), searched by inner product.

    kind "flat" is exact (`faiss.IndexFlatIP`): the reference every approximate index is measured
    against. "ivf" (`IndexIVFFlat`; params nlist, nprobe) and "hnsw" (`IndexHNSWFlat`; params M,
    ef_search, ef_construction) are approximate; see their builders for the defaults. The vectors
    are copied (float32, CPU), so later changes to `embeddings` do not leak in.
    """
    valid = index_params(kind)  # also rejects an unknown kind
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for index kind {kind!r}; valid ones: "
                         f"{valid if valid else 'none (it takes no parameters)'}")
    x = as_float32_matrix(embeddings, "embeddings")  # (N, E)
    if len(x) == 0:
        raise ValueError("cannot index an empty gallery (0 embeddings)")
    index = INDEX_KINDS[kind](x.shape[1], len(x), **params)
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


def set_search_params(index: faiss.Index, *, nprobe: int | None = None,
                      ef_search: int | None = None) -> faiss.Index:
    """Change the search-time knob of a built index in place (no rebuild); returns the index.

    nprobe: IVF lists scanned per query (capped at nlist). ef_search: HNSW candidates kept per
    query. Each applies only to its own kind of index.
    """
    if nprobe is None and ef_search is None:
        raise ValueError("nothing to set: pass nprobe= (IVF indexes) or ef_search= (HNSW indexes)")
    name = type(index).__name__
    if nprobe is not None:
        if not isinstance(index, faiss.IndexIVF):
            raise ValueError(f"nprobe applies to IVF indexes only, not to {name}; "
                             + ("use ef_search= for HNSW" if isinstance(index, faiss.IndexHNSW)
                                else "an exact index has no search-time knob"))
        index.nprobe = min(_positive_int("nprobe", nprobe), index.nlist)
    if ef_search is not None:
        if not isinstance(index, faiss.IndexHNSW):
            raise ValueError(f"ef_search applies to HNSW indexes only, not to {name}; "
                             + ("use nprobe= for IVF" if isinstance(index, faiss.IndexIVF)
                                else "an exact index has no search-time knob"))
        index.hnsw.efSearch = _positive_int("ef_search", ef_search)
    return index


def _current_params(index: faiss.Index) -> dict:
    """The parameters an index was built and is searched with, as build_index names them."""
    if isinstance(index, faiss.IndexIVF):
        return {"nlist": int(index.nlist), "nprobe": int(index.nprobe)}
    if isinstance(index, faiss.IndexHNSW):
        return {"M": int(index.hnsw.nb_neighbors(1)), "ef_search": int(index.hnsw.efSearch),
                "ef_construction": int(index.hnsw.efConstruction)}
    return {}


def recall_vs_exact(index: faiss.Index, exact_index: faiss.Index, queries, k: int) -> float:
    """k-recall@k of the ANN benchmarks: the mean fraction of each query's exact top-k that
    `index` also returns in its top-k, in [0, 1].

    exact_index (usually build_index(gallery, "flat")) must number the gallery like `index`. k is
    capped at exact_index.ntotal. Items are matched by id, so an exact tie at the k-th place may
    count as a miss.
    """
    if index.d != exact_index.d:
        raise ValueError(f"the indexes hold {index.d}-d and {exact_index.d}-d vectors; "
                         "build both over the same gallery")
    exact = search(exact_index, queries, k)[1]  # (Q, k)
    approx = search(index, queries, exact.shape[1])[1]  # (Q, <= k); -1 where FAISS found too few
    found = (exact[:, :, None] == approx[:, None, :]).any(axis=2)  # (Q, k): exact hit returned?
    return float(found.mean())


DEFAULT_TRADEOFF_CONFIGS: tuple[tuple[str, dict], ...] = (
    ("flat", {}),
    ("ivf", {"nprobe": 2}), ("ivf", {"nprobe": 8}), ("ivf", {"nprobe": 32}),
    ("hnsw", {"ef_search": 16}), ("hnsw", {"ef_search": 64}), ("hnsw", {"ef_search": 256}),
)


def index_tradeoff(gallery, queries, k: int = 10,
                   configs: Sequence[tuple[str, dict]] = DEFAULT_TRADEOFF_CONFIGS, *,
                   repeats: int = 50, warmup: int = 5) -> list[dict]:
    """Recall against exact search vs latency of one query, for each (kind, params) setting.

    Each setting gets its own build_index(gallery, kind, **params). Rows, in the order of configs:
    {"kind", "params" (all of them, defaults and clamping applied), "recall_at_k" (recall_vs_exact
    over all queries), "ms_per_query" (median over `repeats` single-query searches, cycling
    through the queries; FAISS only, without input checks), "build_s" (train + add, one run)}.
    """
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    exact = build_index(gallery, "flat")
    q = as_float32_matrix(queries, "queries")  # (Q, E)
    if len(q) == 0:
        raise ValueError("index_tradeoff needs at least one query (got 0 rows)")
    singles = [q[i:i + 1] for i in range(len(q))]  # Q contiguous (1, E) batches of one
    rows = []
    for config in configs:
        if not (isinstance(config, (tuple, list)) and len(config) == 2
                and isinstance(config[1], dict)):
            raise ValueError(f"each config must be a (kind, params dict) pair such as "
                             f"('ivf', {{'nprobe': 4}}), got {config!r}")
        kind, params = config
        built = {}
        build = benchmark(lambda: built.update(index=build_index(gallery, kind, **params)),
                          warmup=0, repeats=1)
        index = built["index"]
        k_eff = min(int(k), index.ntotal)
        cycle = itertools.cycle(singles)
        latency = benchmark(lambda: index.search(next(cycle), k_eff), warmup=warmup,
                            repeats=repeats)
        rows.append({"kind": kind, "params": _current_params(index),
                     "recall_at_k": recall_vs_exact(index, exact, q, k),
                     "ms_per_query": latency.median_ms, "build_s": build.median_ms / 1e3})
    return rows


def embedding_bytes(n_items: int, dim: int, dtype=np.float32) -> int:
    """Bytes to store n_items vectors of dim numbers of dtype (numpy or torch dtype).

    embedding_bytes(1, 768) = 3,072 (one LightningDOT image vector) vs embedding_bytes(36, 2048)
    = 294,912 (its 36 region features): 96 x smaller, before any compression.
    """
    if n_items < 0 or dim < 0:
        raise ValueError(f"n_items and dim must be >= 0, got {n_items} and {dim}")
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else np.dtype(dtype).itemsize
    return int(n_items) * int(dim) * itemsize


__all__ = ["INDEX_KINDS", "DEFAULT_TRADEOFF_CONFIGS", "as_float32_matrix", "build_index",
           "index_params", "search", "set_search_params", "brute_force_topk", "recall_vs_exact",
           "index_tradeoff", "embedding_bytes"]
