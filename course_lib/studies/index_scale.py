"""An index of millions: which FAISS index serves a gallery of 10^6-10^7 embeddings, measured.

For each size and index kind: build time, bytes per item, k-recall@10 against exact search,
ms per query one at a time and batched, recall and latency as nprobe / ef_search vary, and the
flat index's GFLOP/s against torch.mm. The gallery: the "full" split's LightningDOT image
embeddings, then noisy copies of them (core.tiling.tile_rows, noise 0.25 x each dimension's std:
about as far apart as two real images); queries: held-out test captions.

    python -m course_lib.studies.index_scale --sizes 1000000 10000000 --out outputs/index_scale
    python -m course_lib.studies.index_scale --smoke   # 10^5 items, 100 queries: under a minute"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import time
from pathlib import Path

import faiss
import numpy as np
import torch
from tqdm.auto import tqdm

from course_lib.core import retrieval, settings
from course_lib.core import shipped as shipped_models
from course_lib.core.checkpoints import CHECKPOINTS
from course_lib.core.index_eval import _timed_build, time_single_queries, topk_recall
from course_lib.core.roofline import exact_search_flops, gflops
from course_lib.core.tiling import tile_rows
from course_lib.core.timing import measure
from course_lib.data.synthetic import SyntheticConfig, make_benchmark
from course_lib.data.tokenizer import build_word_tokenizer
from course_lib.methods.encoding import encode_captions, encode_gallery
from course_lib.methods.lightningdot.method import build_lightningdot
from course_lib.methods.registry import available_methods
from course_lib.studies.index_scale_report import results_markdown

KINDS = ("flat", "ivf", "ivfpq", "hnsw", "hnswpq")
NLIST_CAP = 1024  # adding n vectors to IVF costs n * nlist * E multiply-adds: 10^7 in minutes
TRAIN_PER_LIST = 50  # k-means trains on 50 vectors per list (FAISS asks for at least 39)
HNSW_GRAPH = {"M": 16, "ef_construction": 40}  # lighter than retrieval's: 10^6 in ~2 min, 1 thread
PQ = {"m": 16, "nbits": 8}  # retrieval's defaults: 16 sub-vectors of 4 numbers, one byte each
PQ_TRAIN = 64 * 256  # hnswpq's codebooks learn from 64 vectors per centroid (ivfpq: its IVF sample)
_PROBES, _EFS = ("nprobe", (1, 2, 4, 8, 16, 32, 64)), ("ef_search", (16, 32, 64, 128, 256))
SWEEP = {"ivf": _PROBES, "ivfpq": _PROBES, "hnsw": _EFS, "hnswpq": _EFS}
# the study runs in retrieval.blas_switch(), and also times exact search on FAISS's default switch
DEFAULT_PATH_MAX_N = 1_000_000  # ... up to this gallery size
SINGLE_BUDGET_S = 1.0  # single-query timing stops after about this long (at least 5 repeats)
CHUNK = 1 << 16  # gallery rows per generation / torch.mm block


def study_config(kind: str, n: int) -> tuple[dict, int | None]:
    """(build_index params, train_size) of an index kind at gallery size n, as the study uses."""
    nlist = max(1, min(NLIST_CAP, round(math.sqrt(n)), n // 39))
    configs = {"flat": ({}, None),
               "ivf": ({"nlist": nlist, "nprobe": 16}, TRAIN_PER_LIST * nlist),
               "ivfpq": ({"nlist": nlist, "nprobe": 16, **PQ}, TRAIN_PER_LIST * nlist),
               "hnsw": ({**HNSW_GRAPH, "ef_search": 64}, None),
               "hnswpq": ({**HNSW_GRAPH, "ef_search": 64, **PQ}, PQ_TRAIN)}
    if kind not in configs:
        raise ValueError(f"unknown index kind {kind!r}; the study measures {list(KINDS)}")
    return configs[kind]


def load_embeddings(smoke: bool = False, checkpoints=CHECKPOINTS, seed: int = 0,
                    n_queries: int = 1000,
                    progress: bool = True) -> tuple[np.ndarray, np.ndarray, str]:
    """(image embeddings (N0, E) of the "full" split, its test queries' caption embeddings (Q, E),
    which model): the shipped or cached trained LightningDOT, else a random-weight one."""
    bench = make_benchmark(SyntheticConfig.smoke() if smoke else SyntheticConfig(), seed=seed)
    tokenizer = build_word_tokenizer(bench["train"].captions + bench["pretrain"].captions)
    method = available_methods(seed, smoke, names=["lightningdot"])[0]
    folder = None if checkpoints is None else Path(checkpoints)
    stage = method.stage(bench, tokenizer)
    cached = stage.path(folder)
    shipped = None if smoke else shipped_models.find_shipped(
        shipped_models.shipped_folder(), method.name, stage)
    mode = "smoke" if smoke else "default"
    if shipped is not None or (cached is not None and cached.exists()):
        method.progress = progress
        model = method.fit(bench, tokenizer, cache_dir=folder).model
        source = f"trained LightningDOT ({mode} config), checkpoint {method.checkpoint_path}"
    else:
        settings.seed_everything(seed)
        model = build_lightningdot(method.config, bench["train"], tokenizer).eval()
        source = (f"random-weight LightningDOT ({mode} config, untrained: no checkpoint "
                  f"{'folder given' if cached is None else f'at {cached}'})")
    full = bench["full"]
    images = encode_gallery(model, full, progress=progress).numpy()  # (N0, E)
    captions = encode_captions(model, full, tokenizer, indices=full.text_queries[:n_queries],
                               progress=progress).numpy()  # (Q, E)
    return images, captions, source


def mm_gflops(queries: np.ndarray, gallery: np.ndarray) -> float:
    """GFLOP/s of torch.mm of exact search's shape (Q, E) x (E, N), CHUNK gallery rows at a time
    into one reused output (a 10^7-column one is 40 GB)."""
    q, g = torch.from_numpy(queries), torch.from_numpy(gallery)  # (Q, E), (N, E): no copies
    out = torch.empty(len(q), min(CHUNK, len(g)))  # (Q, c)

    def product():
        for start in range(0, len(g), CHUNK):
            block = g[start:start + CHUNK]  # (c, E)
            torch.mm(q, block.T, out=out[:, :len(block)])

    torch.mm(q, g[:CHUNK].T, out=out[:, :min(CHUNK, len(g))])  # warm-up: one block
    return gflops(exact_search_flops(len(q), len(g), g.shape[1]), _timed(product))


def code_bytes(index: faiss.Index) -> int:
    """Bytes an index stores per item for its vector (4 * E, or the PQ code), links not counted."""
    storage = faiss.downcast_index(index.storage) if isinstance(index, faiss.IndexHNSW) else index
    return int(storage.code_size)


def index_bytes(index: faiss.Index) -> int:
    """Bytes of the serialised index, counted chunk by chunk (a 10^7-item index is not copied)."""
    sizes = []

    def count(chunk: bytes) -> int:
        sizes.append(len(chunk))
        return len(chunk)

    writer = faiss.PyCallbackIOWriter(count, 1 << 22)
    faiss.write_index(index, writer)
    del writer  # flushes the last chunk
    return sum(sizes)


def _timed(fn) -> float:
    """Milliseconds of one fn() call; a call under a second is timed 3 more times (median)."""
    once = measure(fn, warmup=0, repeats=1).median_ms
    return once if once >= 1000 else measure(fn, warmup=0, repeats=3).median_ms


def _point(index, queries, exact_ids, k: int, repeats: int) -> tuple[dict, np.ndarray]:
    """(recall and latency of a built index at its current setting, its batched ids (Q, k))."""
    found = {}
    ms_batched = _timed(lambda: found.update(ids=index.search(queries, k)[1])) / len(queries)
    ids = found["ids"]  # (Q, k)
    probe = time_single_queries(index, queries, k, warmup=1, repeats=1).median_ms
    repeats = max(5, min(repeats, int(SINGLE_BUDGET_S * 1e3 / max(probe, 1e-3))))
    single = time_single_queries(index, queries, k, warmup=2, repeats=repeats)
    recall = topk_recall(ids, ids if exact_ids is None else exact_ids)
    return {"recall_at_k": recall, "ms_single": single.median_ms, "single_repeats": repeats,
            "ms_batched": ms_batched}, ids


def measure_kind(gallery, queries, exact_ids, kind: str, k: int = 10,
                 repeats: int = 50) -> tuple[dict, list[dict], np.ndarray]:
    """Build one index kind over gallery (n, E) and measure it at its default and each SWEEP
    setting: (row, sweep rows, its batched ids (Q, k)). exact_ids: None for "flat"."""
    params, train_size = study_config(kind, len(gallery))
    index, build = _timed_build(gallery, kind, {**params, "train_size": train_size})
    main, ids = _point(index, queries, exact_ids, k, repeats)
    row = {"kind": kind, "n": len(gallery), "params": retrieval.current_params(index),
           "train_size": train_size, "build_s": build.median_ms / 1e3,
           "bytes_per_item": index_bytes(index) / len(gallery), "code_bytes": code_bytes(index),
           **main}
    knob, values = SWEEP.get(kind, (None, ()))
    points = []
    for value in values:
        point = main  # the main row's setting: measured already
        if value != row["params"][knob]:
            retrieval.set_search_params(index, **{knob: value})
            point = _point(index, queries, exact_ids, k, repeats)[0]
        points.append({"kind": kind, "n": len(gallery), "knob": knob, "value": value, **point})
    return row, points, ids


def _skip_reason(kind: str, n: int, rows: list[dict], max_build_s: float) -> str | None:
    """Why `kind` is not built at n: its build time scaled from its largest smaller gallery (as n,
    or n log n for HNSW) exceeds max_build_s. None: build it ("flat" always is)."""
    smaller = [r for r in rows if r["kind"] == kind and r["n"] < n]
    if kind == "flat" or not smaller:
        return None
    last = max(smaller, key=lambda r: r["n"])
    graph = kind.startswith("hnsw")
    growth = math.log(n) / math.log(last["n"]) if graph else 1
    predicted = last["build_s"] * n / last["n"] * growth
    if predicted <= max_build_s:
        return None
    return (f"its build would take about {predicted:.0f} s ({last['build_s']:.0f} s at "
            f"n={last['n']:,} scaled as {'n log n' if graph else 'n'}) > "
            f"max_build_s={max_build_s:.0f} s on {torch.get_num_threads()} thread(s)")


def run(sizes=(1_000_000, 10_000_000), *, kinds=KINDS, n_queries: int = 1000, k: int = 10,
        repeats: int = 50, construction: str = "tiled", noise: float = 0.25,
        max_build_s: float = 300.0, smoke: bool = False, checkpoints=CHECKPOINTS, seed: int = 0,
        out=None, progress: bool = True) -> dict:
    """The whole study (and out/results.json, results.md). "flat" runs first: the exact top k."""
    start, load_start = time.perf_counter(), os.getloadavg()
    sizes = sorted({int(n) for n in sizes})
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not sizes or sizes[0] < 1:
        raise ValueError(f"need sizes >= 1 and kinds among {list(KINDS)}; got {sizes}, unknown "
                         f"{unknown}")
    kinds = ["flat"] + [kind for kind in KINDS if kind in kinds and kind != "flat"]
    threads = torch.get_num_threads()
    faiss.omp_set_num_threads(threads)  # FAISS on torch's threads: one budget
    images, captions, source = load_embeddings(smoke, checkpoints, seed, n_queries, progress)
    queries = retrieval.as_float32_matrix(captions, "queries")  # (Q, E)
    results = {"indexes": [], "sweep": [], "exact_vs_mm": [], "skipped": []}
    steps = tqdm(total=len(sizes) * len(kinds), desc="index study", disable=not progress)
    default_threshold = faiss.cvar.distance_compute_blas_threshold
    with retrieval.blas_switch():
        tuned = faiss.cvar.distance_compute_blas_threshold
        for n in sizes:
            steps.set_postfix(n=f"{n:,}", step="gallery")
            gallery = tile_rows(images, n, construction=construction, noise=noise, seed=seed,
                                progress=progress)
            exact_ids = None  # (Q, k) once "flat" has run
            for kind in kinds:
                steps.set_postfix(n=f"{n:,}", kind=kind)
                if reason := _skip_reason(kind, n, results["indexes"], max_build_s):
                    print(f"skipping {kind} at n={n:,}: {reason}")
                    results["skipped"].append({"kind": kind, "n": n, "reason": reason})
                else:
                    row, points, ids = measure_kind(gallery, queries, exact_ids, kind, k, repeats)
                    results["indexes"].append(row)
                    results["sweep"] += points
                    if kind == "flat":
                        exact_ids = ids
                        results["exact_vs_mm"].append(
                            _exact_vs_mm(row, queries, gallery, k, default_threshold))
                    gc.collect()  # let the index go before the next one is built
                steps.update()
            del gallery
            gc.collect()
    steps.close()
    env = settings.describe_environment()
    rest = (f"copies tiled with Gaussian noise of {noise} x each dimension's std"
            if construction == "tiled" else "rows drawn from a Gaussian fitted to them")
    results["meta"] = {
        "device": env["device"], "cpu": _cpu_name(), "torch": env["torch"], "faiss": env["faiss"],
        "torch_threads": threads, "faiss_threads": faiss.omp_get_max_threads(),
        "blas_threshold": {"used": tuned, "faiss_default": default_threshold,
                           "default_timed_up_to": DEFAULT_PATH_MAX_N},
        "sizes": sizes, "kinds": kinds, "queries": len(queries), "k": k,
        "dim": int(queries.shape[1]), "embeddings": source,
        "gallery": f"the {len(images):,} real image embeddings of the full split, then {rest}",
        "mode": "smoke" if smoke else "default", "seed": seed, "max_build_s": max_build_s,
        "seconds": round(time.perf_counter() - start, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2),
        "load_average_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)]}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "results.md").write_text(results_markdown(results))
    return results


def _exact_vs_mm(flat_row: dict, queries: np.ndarray, gallery: np.ndarray, k: int,
                 default_threshold: int) -> dict:
    """The flat index's batched GFLOP/s, on both BLAS switches, against torch.mm's."""
    flops = exact_search_flops(len(queries), len(gallery), gallery.shape[1])
    faiss_ms, default_ms = flat_row["ms_batched"] * len(queries), None
    if len(gallery) <= DEFAULT_PATH_MAX_N:
        index = retrieval.build_index(gallery, "flat")
        tuned = faiss.cvar.distance_compute_blas_threshold
        faiss.cvar.distance_compute_blas_threshold = default_threshold
        try:
            default_ms = _timed(lambda: index.search(queries, k))
        finally:
            faiss.cvar.distance_compute_blas_threshold = tuned
    mm_rate = mm_gflops(queries, gallery)
    return {"n": len(gallery), "queries": len(queries), "dim": gallery.shape[1],
            "gflop": flops / 1e9, "faiss_ms": faiss_ms, "faiss_gflops": gflops(flops, faiss_ms),
            "mm_gflops": mm_rate, "fraction": gflops(flops, faiss_ms) / mm_rate,
            "default_ms": default_ms,
            "default_fraction": None if default_ms is None else gflops(flops, default_ms) / mm_rate}


def _cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [line.split(":", 1)[1].strip() for line in info.splitlines()
             if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown CPU"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--sizes", type=int, nargs="+", help="gallery sizes (default 10^6 and 10^7; smoke 10^5)")
    add("--smoke", action="store_true",
        help="10^5 items, 100 queries, smoke models (also COURSE_SMOKE=1)")
    add("--out", default="outputs/index_scale", help="folder for results.json and results.md")
    add("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="kinds (flat always runs)")
    add("--queries", type=int, help="held-out caption queries (default 1000; smoke 100)")
    add("--construction", choices=("tiled", "gaussian"), default="tiled",
        help="rows after the real ones")
    add("--noise", type=float, default=0.25, help="tiled: noise std, a fraction of each dim's std")
    add("--max-build-s", type=float, default=300.0, help="skip kinds whose build would take longer")
    add("--checkpoints", default=CHECKPOINTS, help="folder of cached trained models")
    add("--seed", type=int, default=0, help="seed of the data, fallback weights and the noise")
    args = parser.parse_args(argv)
    smoke = args.smoke or settings.smoke_mode()
    results = run(args.sizes or ([100_000] if smoke else [1_000_000, 10_000_000]), kinds=args.kinds,
                  n_queries=args.queries or (100 if smoke else 1000), repeats=20 if smoke else 50,
                  construction=args.construction, noise=args.noise, max_build_s=args.max_build_s,
                  smoke=smoke, checkpoints=args.checkpoints, seed=args.seed, out=args.out)
    print(results_markdown(results))
    print(f"wrote {Path(args.out) / 'results.json'} and results.md")
    return results


if __name__ == "__main__":
    main()
