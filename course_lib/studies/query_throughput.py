"""Latency and throughput are different questions: queries per second when queries come one at a
time or in batches of 32 or 1,024, against galleries of 1k, 12k and 10^6 items, exact and HNSW,
beside the limit a plain matrix product of the same shape sets (notebook 03, section 10).

One query at a time, a dual encoder pays its fixed costs (tokeniser, operator dispatch, a
(1, E) x (E, N) product that reads the whole gallery for 2 N E flops: memory-bound) per query. A
batch of B shares them: one encoder forward, one (B, E) x (E, N) product reading the gallery once
for B queries, so exact search climbs towards the machine's GEMM rate. HNSW visits a few hundred
items per query whatever N is: it wins at 10^6 one at a time, but has nothing to batch into.

    rows = throughput(images, queries, sizes=(1_000, 12_000, 1_000_000), batches=(1, 32, 1_024))
    encoding = encode_throughput(encode_batch, captions, batches)

The galleries are tile_rows of real embeddings and the HNSW graph is index_scale's (study_config):
this study measures the indexes that one builds, at the batch sizes it does not.
"""

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
    """`count` batches of `batch` query rows (B, E), random draws (with replacement when too few):
    timing cycles through them, as a repeated query would find its gallery rows already cached."""
    rng = np.random.default_rng(seed)
    replace = len(queries) < batch
    return [np.ascontiguousarray(queries[rng.choice(len(queries), batch, replace=replace)])
            for _ in range(count)]


def _repeats(ms_once: float, budget_ms: float = 1_000.0) -> int:
    """Timed calls fitting about budget_ms (1 to 50): 1,024 queries over 10^6 items take seconds."""
    return int(min(50, max(1, budget_ms // max(ms_once, 1e-3))))


def _next_batch_search(index, batches, k: int) -> Callable[[], object]:
    """A call of no arguments, index.search(next(batches), k): batches is an iterator of (B, E)."""
    return lambda: index.search(next(batches), k)


def throughput(images, queries, sizes: Sequence[int], batches: Sequence[int] = BATCHES, *,
               kinds: Sequence[str] = KINDS, k: int = 10, noise: float = 0.25, seed: int = 0,
               progress: bool = True) -> list[dict]:
    """Search throughput of each index kind at each gallery size and batch size. images (N0, E):
    the real gallery rows tile_rows grows to each size; queries (Q, E): the caption embeddings a
    batch is drawn from. Rows: {"n", "kind", "batch", "ms_per_batch", "qps", "gemm_qps"}; gemm_qps
    (exact search only): the queries per second a torch.mm of the same (B, E) x (E, n) shape
    reaches on this thread count, the ceiling of exact search at that batch."""
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
                    k_eff = min(k, n)
                    once = measure(_next_batch_search(index, asked, k_eff), warmup=1,
                                   repeats=1).median_ms
                    ms = measure(_next_batch_search(index, asked, k_eff), warmup=0,
                                 repeats=_repeats(once)).median_ms
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
    """Captions encoded per second when encode_batch(list of B captions) encodes B at once
    (tokeniser included). Rows: {"batch", "ms_per_batch", "qps"}."""
    captions = list(captions)
    rows = []
    for batch in batches:
        texts = (captions * (batch // max(len(captions), 1) + 1))[:batch]
        once = measure(partial(encode_batch, texts), warmup=1, repeats=1).median_ms
        ms = measure(partial(encode_batch, texts), warmup=1, repeats=_repeats(once)).median_ms
        rows.append({"batch": batch, "ms_per_batch": ms, "qps": batch / ms * 1e3})
    return rows


def end_to_end(search_rows: list[dict], encode_qps: dict) -> list[dict]:
    """Each search row with "encode_qps" (encode_qps[batch]) and "total_qps": a batch is encoded,
    then searched, so the times add: 1 / (1 / encode + 1 / search)."""
    return [{**row, "encode_qps": encode_qps[row["batch"]],
             "total_qps": 1.0 / (1.0 / encode_qps[row["batch"]] + 1.0 / row["qps"])}
            for row in search_rows]


def format_throughput(rows: list[dict]) -> str:
    """Markdown: one line per (gallery size, kind), queries per second at each batch size: search
    alone, encode + search, and (exact search) the GEMM limit."""
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


__all__ = ["KINDS", "BATCHES", "throughput", "encode_throughput", "end_to_end", "format_throughput"]
