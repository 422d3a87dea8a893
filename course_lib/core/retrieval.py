"""Search over embedded galleries: exact and approximate FAISS indexes (PQ-compressed too) and
their brute-force reference. A dual encoder makes retrieval maximum inner-product search: the
gallery is embedded once, offline, and a query costs one encoding plus a top-k over N dot products.

    index = build_index(image_emb)                   # (N, E), "flat" = exact IndexFlatIP
    scores, indices = search(index, text_emb, k=10)  # (Q, k) numpy, best first
    build_index(x, "ivf", nlist=64, nprobe=8)        # also "hnsw", "ivfpq", "hnswpq"
    set_search_params(index, nprobe=16)              # the search-time knob: more recall, more time

Product quantisation (PQ; Jégou et al., TPAMI 2011) stores each of m sub-vectors as its nearest
of 2^nbits learnt centroids: m * nbits / 8 bytes instead of 4 * dim."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from contextlib import contextmanager

import faiss
import numpy as np
import torch

from course_lib.core.settings import CourseNote

IP = faiss.METRIC_INNER_PRODUCT  # every index here ranks by inner product
MIN_POINTS_PER_LIST = 39  # FAISS k-means warns below this many points per centroid
# FAISS >= 1.15 scores nq rows with its own loop while nq * dim < 128,000, with BLAS above; BLAS
# wins far earlier (facebookresearch/faiss#5109; docs/tuning_notes.md, "FAISS's BLAS switch").
BLAS_SWITCH_PER_THREAD = 800


@contextmanager
def blas_switch(per_thread: int = BLAS_SWITCH_PER_THREAD):
    """Within the block FAISS switches to BLAS by nq * dim >= per_thread * its threads."""
    cvar, before = faiss.cvar, faiss.cvar.distance_compute_blas_threshold
    cvar.distance_compute_blas_threshold = min(before, per_thread * faiss.omp_get_max_threads())
    try:
        yield
    finally:
        cvar.distance_compute_blas_threshold = before


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _ivf(quantizer_to_index, dim: int, n: int, nlist: int | None, nprobe: int) -> faiss.Index:
    """quantizer_to_index(quantizer, nlist), nlist (default about 4 sqrt(n)) clamped to
    [1, n // 39] so every list trains well, nprobe capped at nlist."""
    cap = max(1, n // MIN_POINTS_PER_LIST)
    if nlist is None:
        nlist = min(cap, max(1, round(4 * math.sqrt(n))))
    elif _positive_int("nlist", nlist) > cap:
        warnings.warn(f"nlist={nlist} needs {nlist * MIN_POINTS_PER_LIST} training vectors "
                      f"({MIN_POINTS_PER_LIST} per list) but the gallery has {n}; using "
                      f"nlist={cap}. Pass nlist <= {cap} or no nlist", CourseNote, stacklevel=4)
        nlist = cap
    index = quantizer_to_index(faiss.IndexFlatIP(dim), nlist)  # the centroids; kept alive by index
    index.cp.min_points_per_centroid = 1  # we capped nlist ourselves; silence FAISS's n < 39 note
    index.nprobe = min(_positive_int("nprobe", nprobe), nlist)
    return index


def _ivf_flat(dim: int, n: int, *, nlist: int | None = None, nprobe: int = 8) -> faiss.Index:
    """IVF: k-means splits the gallery into nlist lists; a query scans only its nprobe best."""
    return _ivf(lambda q, nlist: faiss.IndexIVFFlat(q, dim, nlist, IP), dim, n, nlist, nprobe)


def _pq_shape(dim: int, n: int, m: int | None, nbits: int) -> tuple[int, int]:
    """Checked (m, nbits) of a product quantiser of dim-d vectors trained on n. m defaults to the
    largest divisor of dim up to dim / 4 (16 bytes for 64-d vectors); n >= 2^nbits."""
    m = max(d for d in range(1, max(1, dim // 4) + 1) if dim % d == 0) if m is None else m
    if _positive_int("m", m) > dim or dim % m:
        raise ValueError(f"m={m} sub-quantizers must divide the dimension {dim} evenly; pick one "
                         f"of {[d for d in range(1, dim + 1) if dim % d == 0]}")
    if _positive_int("nbits", nbits) > 16:
        raise ValueError(f"nbits must be an integer in [1, 16], got {nbits}; 8 is usual")
    if n < 2 ** nbits:
        raise ValueError(f"nbits={nbits} trains {2 ** nbits} centroids per sub-vector but only "
                         f"{n} vectors train it; pass nbits <= {max(1, int(math.log2(n)))} or a "
                         "larger gallery (or use 'ivf' / 'hnsw', which store the vectors)")
    if n < MIN_POINTS_PER_LIST * 2 ** nbits:
        warnings.warn(f"PQ with nbits={nbits} is trained on {n} vectors, fewer than "
                      f"{MIN_POINTS_PER_LIST} per centroid ({MIN_POINTS_PER_LIST * 2 ** nbits}): "
                      "its codebooks, and so its recall, suffer; use more vectors or fewer nbits",
                      CourseNote, stacklevel=4)
    return int(m), int(nbits)


def _ivf_pq(dim: int, n: int, *, nlist: int | None = None, nprobe: int = 8,
            m: int | None = None, nbits: int = 8) -> faiss.Index:
    """IVF-PQ: "ivf"'s lists of PQ codes of residuals; scores are approximate even when probed."""
    m, nbits = _pq_shape(dim, n, m, nbits)
    index = _ivf(lambda q, nlist: faiss.IndexIVFPQ(q, dim, nlist, m, nbits, IP),
                 dim, n, nlist, nprobe)
    index.pq.cp.min_points_per_centroid = 1  # _pq_shape warned already; silence FAISS's note
    return index


def _hnsw_flat(dim: int, n: int, *, M: int = 32, ef_search: int = 64,
               ef_construction: int = 80) -> faiss.Index:
    """HNSW: a layered graph with M links per node (2M at the bottom), walked greedily, keeping
    ef_construction candidates while inserting, ef_search (>= k) while searching."""
    index = faiss.IndexHNSWFlat(dim, _positive_int("M", M, minimum=2), IP)
    index.hnsw.efConstruction = _positive_int("ef_construction", ef_construction)
    index.hnsw.efSearch = _positive_int("ef_search", ef_search)
    return index


def _hnsw_pq(dim: int, n: int, *, M: int = 32, ef_search: int = 64, ef_construction: int = 80,
             m: int | None = None, nbits: int = 8) -> faiss.Index:
    """HNSW whose nodes store PQ codes, not vectors; build_index fixes its code-to-code table."""
    m, nbits = _pq_shape(dim, n, m, nbits)
    index = faiss.IndexHNSWPQ(dim, m, _positive_int("M", M, minimum=2), nbits, IP)
    faiss.downcast_index(index.storage).pq.cp.min_points_per_centroid = 1  # as in _ivf_pq
    index.hnsw.efConstruction = _positive_int("ef_construction", ef_construction)
    index.hnsw.efSearch = _positive_int("ef_search", ef_search)
    return index


# name -> builder(dim, n, **params) of an empty index; its keyword-only arguments are the
# parameters build_index accepts
INDEX_KINDS: dict[str, Callable[..., faiss.Index]] = {
    "flat": lambda dim, n: faiss.IndexFlatIP(dim),  # exact: scores every stored vector
    "ivf": _ivf_flat, "hnsw": _hnsw_flat, "ivfpq": _ivf_pq, "hnswpq": _hnsw_pq}


def index_params(kind: str) -> list[str]:
    """The parameters build_index accepts for an index kind, e.g. ["nlist", "nprobe"] for "ivf"."""
    if kind not in INDEX_KINDS:
        raise ValueError(f"unknown index kind {kind!r}; valid kinds: {sorted(INDEX_KINDS)}")
    params = inspect.signature(INDEX_KINDS[kind]).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def as_float32_matrix(x, name: str = "embeddings") -> np.ndarray:
    """x (tensor or array-like; 1-D: one row) as the C-contiguous float32 (n, E) FAISS reads."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    x = np.asarray(x)
    x = x[None, :] if x.ndim == 1 else x  # one vector -> (1, E)
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


def build_index(embeddings, kind: str = "flat", *, train_size: int | None = None,
                **params) -> faiss.Index:
    """A FAISS index of INDEX_KINDS[kind] over a float32 copy of embeddings (N, E), searched by
    inner product. train_size: IVF lists and PQ codebooks learn from a fixed random sample."""
    valid = index_params(kind)  # also rejects an unknown kind
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for index kind {kind!r}; valid ones: "
                         f"{valid if valid else 'none (it takes no parameters)'}")
    x = as_float32_matrix(embeddings, "embeddings")  # (N, E)
    if len(x) == 0:
        raise ValueError("cannot index an empty gallery (0 embeddings)")
    train = x
    if train_size is not None and _positive_int("train_size", train_size) < len(x):
        rows = np.random.default_rng(0).choice(len(x), train_size, replace=False)
        train = x[np.sort(rows)]  # (train_size, E), in gallery order
    index = INDEX_KINDS[kind](x.shape[1], len(train), **params)
    if not index.is_trained:
        with blas_switch():  # k-means assigns thousands of rows at once
            index.train(train)
    if isinstance(index, faiss.IndexHNSWPQ):
        _inner_product_code_table(faiss.downcast_index(index.storage).pq)
    index.add(x)
    return index


def _inner_product_code_table(pq: faiss.ProductQuantizer) -> None:
    """IndexHNSWPQ links nodes by pq.sdc_table, squared L2 between centroids even under inner
    product (docs/tuning_notes.md, "HNSW-PQ's code table"): fill it with inner products."""
    centroids = faiss.vector_to_array(pq.centroids).reshape(pq.M, pq.ksub, pq.dsub)  # (M, K, d)
    table = np.einsum("mid,mjd->mji", centroids, centroids)  # (M, K, K): [m, code j, code i]
    faiss.copy_array_to_vector(np.ascontiguousarray(table, dtype=np.float32).ravel(), pq.sdc_table)


def search(index: faiss.Index, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k per query (Q, E) or (E,): (scores (Q, k) float32, indices (Q, k) int64), best first.
    k is capped at the index size (not FAISS's padding of -1 indices)."""
    k = _positive_int("k", k)
    if index.ntotal == 0:
        raise ValueError("the index is empty: add the gallery first (build_index does)")
    q = as_float32_matrix(queries, "queries")  # (Q, E)
    if q.shape[1] != index.d:
        raise ValueError(f"queries have dimension {q.shape[1]} but the index holds {index.d}-d "
                         "vectors; encode them with the same model (and projection)")
    return index.search(q, min(k, index.ntotal))  # (Q, k), (Q, k)


def brute_force_topk(gallery: torch.Tensor, queries: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top-k by inner product with torch, the reference: gallery (N, E), queries (Q, E)
    or (E,) -> (scores (Q, k), indices (Q, k)), k capped at N. Builds the whole (Q, N) matrix."""
    k = _positive_int("k", k)
    gallery, queries = torch.as_tensor(gallery), torch.as_tensor(queries)
    queries = queries.unsqueeze(0) if queries.dim() == 1 else queries  # (Q, E)
    if gallery.dim() != 2 or queries.dim() != 2 or gallery.shape[1] != queries.shape[1]:
        raise ValueError(f"need gallery (N, E) and queries (Q, E) of the same E, got "
                         f"{tuple(gallery.shape)} and {tuple(queries.shape)}")
    if len(gallery) == 0:
        raise ValueError("cannot search an empty gallery (0 embeddings)")
    scores = queries.float() @ gallery.float().T  # (Q, N)
    return torch.topk(scores, min(k, len(gallery)), dim=1)  # sorted, largest first


def set_search_params(index: faiss.Index, *, nprobe: int | None = None,
                      ef_search: int | None = None) -> faiss.Index:
    """Set a built index's search knob in place: nprobe (IVF; <= nlist) or ef_search (HNSW)."""
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


def current_params(index: faiss.Index) -> dict:
    """The parameters an index was built and is searched with, as build_index names them."""
    params, coded = {}, index
    if isinstance(index, faiss.IndexIVF):
        params = {"nlist": int(index.nlist), "nprobe": int(index.nprobe)}
    if isinstance(index, faiss.IndexHNSW):
        params = {"M": int(index.hnsw.nb_neighbors(1)), "ef_search": int(index.hnsw.efSearch),
                  "ef_construction": int(index.hnsw.efConstruction)}
        coded = faiss.downcast_index(index.storage)  # what the graph's nodes store
    if isinstance(coded, (faiss.IndexIVFPQ, faiss.IndexPQ)):
        params |= {"m": int(coded.pq.M), "nbits": int(coded.pq.nbits)}
    return params
