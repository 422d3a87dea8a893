"""Latency and throughput are different questions: queries per second one at a time or in
batches, exact and HNSW, beside the limit a matrix product of the same shape sets (notebook 03).
A batch shares the fixed costs and reads the gallery once for B queries, so exact search climbs
towards the GEMM rate; HNSW visits a few hundred items per query and has nothing to batch into."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
from tqdm.auto import tqdm

from course_lib.core.retrieval import as_float32_matrix, blas_switch, build_index
from course_lib.core.roofline import exact_search_flops
from course_lib.core.tiling import tile_rows
from course_lib.core.timing import measure
from course_lib.studies.index_scale import mm_gflops, study_config

KINDS = ("flat", "hnsw")
BATCHES = (1, 32, 1_024)


def _batches(queries: np.ndarray, batch: int, count: int = 8, seed: int = 0) -> list[np.ndarray]:
    """`count` random batches (B, E) to cycle through (one query repeated would hit the cache)."""
    rng = np.random.default_rng(seed)
    replace = len(queries) < batch
    return [np.ascontiguousarray(queries[rng.choice(len(queries), batch, replace=replace)])
            for _ in range(count)]


def _repeats(ms_once: float, budget_ms: float = 1_000.0) -> int:
    """Timed calls fitting about budget_ms (1 to 50): 1,024 queries over 10^6 items take seconds."""
    return int(min(50, max(1, budget_ms // max(ms_once, 1e-3))))


def _next_batch_search(index, batches, k: int) -> Callable[[], object]:
    return lambda: index.search(next(batches), k)


def throughput(images, queries, sizes: Sequence[int], batches: Sequence[int] = BATCHES, *,
               kinds: Sequence[str] = KINDS, k: int = 10, noise: float = 0.25, seed: int = 0,
               progress: bool = True) -> list[dict]:
    """Search throughput of each index kind at each gallery size (images (N0, E) tiled) and batch
    size (of queries (Q, E)). gemm_qps (flat only): torch.mm's rate at that shape, the ceiling."""
    images, queries = as_float32_matrix(images, "images"), as_float32_matrix(queries, "queries")
    rows = []
    steps = tqdm(total=len(sizes) * len(kinds), desc="throughput", disable=not progress)
    with blas_switch():  # batched exact search on FAISS's BLAS path from a few queries (retrieval)
        for n in sorted(sizes):
            gallery = tile_rows(images, n, noise=noise, seed=seed)  # (n, E)
            for kind in kinds:
                params, train_size = study_config(kind, n)
                index = build_index(gallery, kind, train_size=train_size, **params)
                for batch in batches:
                    asked = itertools.cycle(_batches(queries, batch, seed=seed))  # (B, E) each
                    search = _next_batch_search(index, asked, min(k, n))
                    once = measure(search, warmup=1, repeats=1).median_ms
                    ms = measure(search, warmup=0, repeats=_repeats(once)).median_ms
                    gemm = None
                    if kind == "flat":
                        rate = mm_gflops(next(asked), gallery)  # GFLOP/s of torch.mm of this shape
                        gemm = rate * 1e9 / (exact_search_flops(1, n, gallery.shape[1]))
                    rows.append({"n": n, "kind": kind, "batch": batch, "ms_per_batch": ms,
                                 "qps": batch / ms * 1e3, "gemm_qps": gemm})
                index = None  # let a big index go before the next is built
                steps.update()
            del gallery
    steps.close()
    return rows


def encode_throughput(encode_batch: Callable[[list], object], captions: Sequence[str],
                      batches: Sequence[int] = BATCHES) -> list[dict]:
    """Captions encoded per second when encode_batch encodes B at once (tokeniser included)."""
    captions = list(captions)
    rows = []
    for batch in batches:
        texts = (captions * (batch // max(len(captions), 1) + 1))[:batch]
        once = measure(partial(encode_batch, texts), warmup=1, repeats=1).median_ms
        ms = measure(partial(encode_batch, texts), warmup=1, repeats=_repeats(once)).median_ms
        rows.append({"batch": batch, "ms_per_batch": ms, "qps": batch / ms * 1e3})
    return rows


def end_to_end(search_rows: list[dict], encode_qps: dict) -> list[dict]:
    """Each search row with "encode_qps" and "total_qps" = 1 / (1 / encode + 1 / search)."""
    return [{**row, "encode_qps": encode_qps[row["batch"]],
             "total_qps": 1.0 / (1.0 / encode_qps[row["batch"]] + 1.0 / row["qps"])}
            for row in search_rows]


def format_throughput(rows: list[dict]) -> str:
    """Markdown: per (gallery size, kind), queries per second at each batch size."""
    batches = sorted({r["batch"] for r in rows})
    head = " | ".join(f"B={b:,}: search / +encode / GEMM limit" for b in batches)
    lines = [f"| n | index | {head} |", "|---:|---|" + "---:|" * len(batches)]
    cells = {(r["n"], r["kind"], r["batch"]): r for r in rows}
    for n, kind in dict.fromkeys((r["n"], r["kind"]) for r in rows):
        parts = []
        for b in batches:
            r = cells[n, kind, b]
            total = f"{r['total_qps']:,.0f}" if "total_qps" in r else "–"
            limit = f"{r['gemm_qps']:,.0f}" if r["gemm_qps"] else "–"
            parts.append(f"{r['qps']:,.0f} / {total} / " + limit)
        lines.append(f"| {n:,} | {kind} | " + " | ".join(parts) + " |")
    return "\n".join(lines)
